"""A tokenizer read from a local Hugging Face directory, without transformers.

Implements `tierguard.engine.api.Tokenizer` on top of the `tokenizers` library
(tokenizer.json) plus tokenizer_config.json for special tokens and the chat template,
which is rendered with jinja2 the way transformers renders it.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as _RustTokenizer

from tierguard.common.errors import TierguardError


def _token_text(value: object) -> str | None:
    """Special tokens appear as plain strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TierguardError(f"no tokenizer.json in {model_dir} (only fast tokenizers are supported)")
        self._tok = _RustTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id: int | None = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template: str | None = cfg.get("chat_template")
        if self.chat_template is None and (model_dir / "chat_template.jinja").is_file():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()
        self._template = None
        self.vocab_size = self._tok.get_vocab_size()

    @property
    def backend(self) -> _RustTokenizer:
        """The `tokenizers.Tokenizer` underneath (its JSON gives the serve's byte rule)."""
        return self._tok

    def __getstate__(self) -> dict:
        # Picklable for the tokenizer process pool: the compiled template is rebuilt on use.
        return {**self.__dict__, "_template": None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TierguardError("this tokenizer has no chat template")
        if self._template is None:
            self._template = self._compile(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    @staticmethod
    def _compile(source: str):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except TemplateError as exc:
            raise TierguardError(f"invalid chat template: {exc}") from exc
