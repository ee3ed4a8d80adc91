"""Text in and out with `tokenizers` and the target's own chat template (jinja2, sandboxed).
No transformers: this runs on edge boards."""

from __future__ import annotations

from pathlib import Path

from dflash2.config import check_tokenizer_files, check_tokenizer_vocab, read_json_object
from dflash2.errors import Dflash2Error


class TokenizerError(Dflash2Error):
    pass


class Text:
    def __init__(self, folder: Path, vocab_size: int | None = None):
        """vocab_size: the model's; a tokenizer that does not match it is refused (config.check_tokenizer_vocab)."""
        from tokenizers import Tokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: expected tokenizer.json (copied from the target at export), found none; "
                                 f"text prompts, --stop and text output need it (--prompt-ids without --stop do not)")
        check_tokenizer_files(folder)  # checked at export too; this also covers hand-made folders
        self.tok = Tokenizer.from_file(str(path))
        if vocab_size is not None:
            ids = 1 + max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1)
            check_tokenizer_vocab(path, ids, vocab_size)
        cfg_path = folder / "tokenizer_config.json"
        self.config = read_json_object(cfg_path) if cfg_path.is_file() else {}
        template = self.config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        self.chat_template, self.folder = template, folder

    def _special(self, key: str) -> str:
        v = self.config.get(key)
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            if not self.chat_template:
                raise TokenizerError("--chat: the target's tokenizer_config.json has no chat_template")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            text = self.render(messages)
            return self.tok.encode(text, add_special_tokens=False).ids
        return self.tok.encode(text).ids

    def render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError, TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise TokenizerError(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
        except TemplateSyntaxError as e:
            raise TokenizerError(f"{self.folder}: chat template: expected a jinja template, found a syntax error at "
                                 f"line {e.lineno}: {e.message}") from None
        try:
            return template.render(
                messages=messages, add_generation_prompt=True, bos_token=self._special("bos_token"),
                eos_token=self._special("eos_token"))
        except TokenizerError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError,
                RecursionError, OverflowError) as e:  # a template that fails while rendering (undefined, 1 / 0, ...)
            raise TokenizerError(f"{self.folder}: chat template: expected a template that renders these messages, "
                                 f"found {type(e).__name__}: {str(e)[:200]}") from None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class Stream:
    """Incremental detokenisation for streaming: emits only text that can no longer change
    (HF TextStreamer's rule: flush at newlines, else up to the last space)."""

    def __init__(self, text: Text):
        self.text, self.tokens, self.printed = text, [], 0

    def push(self, ids: list[int]) -> str:
        self.tokens += ids
        s = self.text.decode(self.tokens)
        if s.endswith("\n"):
            out, self.tokens, self.printed = s[self.printed:], [], 0
            return out
        cut = s.rfind(" ") + 1
        out = s[self.printed:cut] if cut > self.printed else ""
        self.printed = max(self.printed, cut)
        return out

    def flush(self) -> str:
        s = self.text.decode(self.tokens)
        out = s[self.printed:]
        self.tokens, self.printed = [], 0
        return out
