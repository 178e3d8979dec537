"""The generated docs are current."""

from pathlib import Path

from moelens.families import table

DOCS = Path(__file__).parents[1] / "docs"


def test_family_table_is_generated_from_the_registry():
    assert (DOCS / "families.md").read_text() == table.markdown(), (
        "docs/families.md is stale: run `python -m moelens.families.table > docs/families.md`"
    )
