"""The progress bar of a pass over a corpus (`collect_routing`, `expert_logit_lens`)."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm  # a widget in Jupyter, text in a terminal

from .corpus import Batch, item_count


class CorpusProgress:
    """A tqdm bar over a corpus pass: over its items where there are several and their number is known without
    reading them (a list of texts, a tensor of rows: the share done and the time left, the tokens beside), else over
    its tokens (one text's windows too). Gone when closed."""

    def __init__(self, corpus: Any, desc: str, enabled: bool) -> None:
        total = item_count(corpus)
        total = total if total is not None and total > 1 else None
        self.tokens = 0
        self.bar = tqdm(total=total, desc=desc, unit="tok" if total is None else "text", disable=not enabled,
                        leave=False, dynamic_ncols=True)

    def advance(self, batch: Batch) -> None:
        """Count ``batch`` in: its tokens, and the items before its last row's (which may go on in the next batch)."""
        self.tokens += batch.num_tokens
        if self.bar.total is None:
            self.bar.update(batch.num_tokens)
        else:
            self.bar.set_postfix_str(f"{self.tokens} tok", refresh=False)
            self.bar.update(max(0, int(batch.text_index.max()) - self.bar.n))

    def finish(self) -> None:
        """The pass read the whole corpus: every item is done (empty ones at its end too)."""
        if self.bar.total is not None:
            self.bar.update(self.bar.total - self.bar.n)

    def close(self) -> None:
        self.bar.close()
