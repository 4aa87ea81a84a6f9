"""The result file of a benchmark run, vLLM-shaped: written by `bench serve` and `simulate`, read by `plot bench`."""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenloom.workload.metrics import RequestRecord

CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass
class BenchResult:
    config: dict[str, Any]
    records: list[RequestRecord]
    metrics: dict[str, Any]
    date: str = field(default_factory=lambda: _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))

    def to_dict(self) -> dict[str, Any]:
        """vLLM-shaped result: config, flat aggregates, vLLM's per-request lists, then our records."""
        ok = [r for r in self.records if r.success]
        return {
            "date": self.date,
            "backend": "openai-chat" if self.config.get("endpoint") == CHAT_COMPLETIONS else "openai",
            **self.config,
            **self.metrics,
            "input_lens": [r.prompt_len for r in ok],
            "output_lens": [r.output_tokens for r in ok],
            "ttfts": [r.ttft_s for r in ok],
            "itls": [r.itl_s for r in ok],
            "e2els": [r.e2e_s for r in ok],
            "errors": [r.error for r in self.records if not r.success],
            "requests": [asdict(r) for r in self.records],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
