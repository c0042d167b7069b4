"""An HF tokenizer seen through the few members pask-local's prompt tagger reads of a llama.cpp model.

``chat.protocol.plan`` (rendering, structural tagging, the call grammar) asks its model for
``chat_template()``, ``tokenize``, ``piece``, ``bos`` and ``add_bos`` only. ``HFVocab`` answers
them from a ``transformers`` tokenizer, so a kvpress user tags a prompt with pask-local's own
renderer and tagger without a GGUF. Token ids are the model's own: for Qwen2.5 they equal what
llama.cpp gives for the same text (tests/test_kvpress_press.py checks it on BFCL prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..chat.protocol import Plan, plan
from ..messages import Message, parse_tool_choice, user_message
from ..schema.tools import as_tools

# llama.cpp's token types (tokenizer.ggml.token_type) that its tokenizer matches as whole tokens in text
_CONTROL, _USER_DEFINED = 3, 4


def gguf_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer of a GGUF file, with the GGUF's control and user-defined tokens registered.

    transformers' GGUF conversion (5.2) registers only the tokens it names (Qwen2.5: the three
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), so ``<tool_call>`` in the template's
    text is spelled as five BPE pieces where llama.cpp (and the original HF tokenizer) give the one
    token the model was trained on. Registering them restores llama.cpp's tokenization: control
    tokens as special (matched only when special tokens are parsed), user-defined ones as plain
    added tokens (always matched, as llama.cpp matches them even without ``parse_special``).
    """
    import gguf
    from transformers import AddedToken, AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reader = gguf.GGUFReader(path)
    kinds, texts = reader.fields["tokenizer.ggml.token_type"], reader.fields["tokenizer.ggml.tokens"]
    control, user = [], []
    for i, part in enumerate(kinds.data):
        kind = int(kinds.parts[part][0])
        if kind in (_CONTROL, _USER_DEFINED):
            text = bytes(texts.parts[texts.data[i]]).decode("utf-8")
            (control if kind == _CONTROL else user).append(AddedToken(text, special=kind == _CONTROL,
                                                                       normalized=False))
    tok.add_tokens(control, special_tokens=True)
    tok.add_tokens(user)
    return tok


class HFVocab:
    """``tokenize`` / ``piece`` / ``chat_template`` of a byte-level BPE HF tokenizer (Qwen2, Llama 3)."""

    def __init__(self, tokenizer: Any) -> None:
        # imported here: transformers is an optional dependency (pask-local[kvpress])
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.tokenizer = tokenizer
        # byte-level BPE spells every byte as one printable character; a piece's raw bytes (possibly
        # half a UTF-8 character) are what the tagger aligns span boundaries on
        self._byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
        self._special = {int(i) for i in tokenizer.all_special_ids}
        self._special |= {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.bos = -1 if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        self.add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and self.bos >= 0
        self.n_vocab = len(tokenizer)

    def chat_template(self) -> str | None:
        t = self.tokenizer.chat_template
        return t if isinstance(t, str) else None

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        # split_special_tokens: "<|im_start|>" typed by a user stays text, as llama.cpp's parse_special=False
        enc = self.tokenizer(text, add_special_tokens=add_special, split_special_tokens=not parse_special)
        return [int(i) for i in enc["input_ids"]]

    def piece(self, token: int, special: bool = True) -> bytes:
        """The token's raw bytes; a control token's text (b"" with ``special`` False, as llama.cpp)."""
        tok = self.tokenizer.convert_ids_to_tokens(int(token))
        if int(token) in self._special:
            return tok.encode("utf-8") if special else b""
        if all(ch in self._byte_of for ch in tok):
            return bytes(self._byte_of[ch] for ch in tok)
        return tok.encode("utf-8")  # an added non-special token is stored as plain text


def tag_request(tokenizer: Any, tools: Any, messages: list[Message] | str, tool_choice: str = "required",
                parallel: bool = False, style: str = "auto", examples: list[tuple[str, str]] | None = None,
                max_string: int | None = 128, max_calls: int | None = 8) -> Plan:
    """pask-local's plan of one request (prompt tokens and structural classes, call grammar, output
    parser) with ``tokenizer``'s vocabulary: ``plan.prompt.tokens`` go to the HF model,
    ``plan.prompt.classes`` to ``PASKPress.bind``. ``max_string``/``max_calls``: the engine's defaults."""
    msgs = user_message(messages) if isinstance(messages, str) else list(messages)
    specs = as_tools(tools)
    choice = parse_tool_choice(tool_choice, [t.name for t in specs])
    return plan(HFVocab(tokenizer), specs, msgs, choice, parallel=parallel,  # type: ignore[arg-type]
                style=style, examples=examples, max_string=max_string, max_calls=max_calls)
