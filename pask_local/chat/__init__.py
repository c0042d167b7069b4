"""Conversations: OpenAI-style messages and tool_choice (``messages``), the assistant's reply
(``result``), the model's tool-call protocol (``protocol``) and the generation-time token chooser
(``decoder``)."""
