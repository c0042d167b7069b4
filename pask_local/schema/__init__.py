"""Tool definitions: normalisation of input formats (``tools``) and function-call grammars (``gbnf``)."""
