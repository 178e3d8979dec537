"""The generated docs are current."""

from pathlib import Path

from moelens.families import table

DOCS = Path(__file__).parents[1] / "docs"


def test_family_table_is_generated_from_the_registry():
    assert (DOCS / "families.md").read_text() == table.markdown(), (
        "docs/families.md is stale: run `python -m moelens.families.table > docs/families.md`"
    )


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
