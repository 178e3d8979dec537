"""The progress bar of a pass over a corpus (`collect_routing`, `expert_logit_lens`)."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm  # a widget in Jupyter, text in a terminal

from .corpus import Batch, item_count


class CorpusProgress:
    """A tqdm bar over a corpus pass: over its items where their number is known without reading it (a list of texts,
    a tensor of rows: the share done and the time left, the tokens beside), else over its tokens. Gone when closed."""

    def __init__(self, corpus: Any, desc: str, enabled: bool) -> None:
        total = item_count(corpus)
        self.tokens = 0
        self.bar = tqdm(total=total, desc=desc, unit="tok" if total is None else "text", disable=not enabled,
                        leave=False, dynamic_ncols=True)

    def advance(self, batch: Batch) -> None:
        """Count ``batch`` in: its tokens, and the items up to its last row's (a text may go on in the next batch)."""
        self.tokens += batch.num_tokens
        if self.bar.total is None:
            self.bar.update(batch.num_tokens)
        else:
            self.bar.set_postfix_str(f"{self.tokens} tok", refresh=False)
            self.bar.update(int(batch.text_index.max()) + 1 - self.bar.n)

    def close(self) -> None:
        self.bar.close()
