"""The generated docs are current."""

import re
from pathlib import Path

from groundtruth import indexer_fields
from moelens.families import table
from moelens.testing import FAMILIES

DOCS = Path(__file__).parents[1] / "docs"


def test_family_table_is_generated_from_the_registry():
    assert (DOCS / "families.md").read_text() == table.markdown(), (
        "docs/families.md is stale: run `python -m moelens.families.table > docs/families.md`"
    )


def test_every_row_of_the_family_tables_has_its_headers_cells():
    """cohere2_moe's scoring code ``TK->SM|sigmoid`` went into the table with a bare ``|``, which markdown reads as a
    cell break: the row's cells shifted and its notes fell off. Ground truth: the header row's cell count."""
    cells = None
    for line in table.markdown().splitlines():
        if not line.startswith("|"):
            cells = None
            continue
        count = len(re.split(r"(?<!\\)\|", line)) - 2  # the bars not escaped, less the line's two ends
        cells = cells or count  # a table's first row: its header
        assert count == cells, line


def test_core_api_lists_every_family_field():
    import dataclasses
    import re

    from moelens.families import Combine, ExpertGate, ExpertLayout, Family, Scoring, SharedExpert

    text = (DOCS / "dev" / "core-api.md").read_text()
    listed = text[text.index("`moelens.families.Family` fields:"):text.index("Attribute references such as")]
    words = set(re.findall(r"\w+", listed))
    for description in (Family, Scoring, SharedExpert, Combine, ExpertGate, ExpertLayout):
        missing = [field.name for field in dataclasses.fields(description) if field.name not in words]
        assert not missing, f"docs/dev/core-api.md does not list {description.__name__} fields {missing}"


def _padding_paragraph() -> str:
    text = (DOCS / "analysis.md").read_text()
    return text[text.index("**Batched, padding excluded**"):text.index("**How it reads**")]


def test_analysis_names_every_family_with_a_sparse_attention_indexer():
    """Every family whose tiny config sizes an indexer is named where docs/analysis.md says what padding does
    (whether in its exception, test_analysis_guards checks by running each with and without padding)."""
    paragraph = _padding_paragraph()
    indexed = [family for family in FAMILIES if indexer_fields(family)]
    assert any("index_topk" in indexer_fields(family) for family in indexed), "no tiny config has index_topk"
    missing = [family for family in indexed if family not in set(re.findall(r"\w+", paragraph))]
    assert not missing, f"docs/analysis.md's padding paragraph does not name the indexer families {missing}"
