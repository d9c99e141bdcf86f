"""docs/configuration.md is generated from the config classes and must match them."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from common.config import DEFAULT_CONFIG_PATH, config_keys, load_config
from scripts.gen_config_docs import (
    DOC_PATH,
    REGENERATE,
    SECTIONS,
    attribute_docs,
    key_doc,
    main,
    render,
)


def test_configuration_md_matches_the_config_classes() -> None:
    assert DOC_PATH.read_text() == render(), (
        f"{DOC_PATH.name} is out of date with the config classes: run `{REGENERATE}` "
        "(python -m scripts.gen_config_docs) and commit the result"
    )


def test_check_mode_passes_on_the_committed_page() -> None:
    assert main(["--check"]) == 0


def test_every_section_of_the_stack_file_is_documented() -> None:
    sections = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    assert set(sections) == set(SECTIONS)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_key_has_a_meaning_and_the_stack_file_loads(section: str) -> None:
    cls, _ = SECTIONS[section]
    for key in config_keys(cls, section):
        assert key_doc(key).strip(), key.path
    load_config(cls, section, path=DEFAULT_CONFIG_PATH, env={})  # no unknown or bad key


def test_attribute_docs_read_groups_and_continuations() -> None:
    @dataclasses.dataclass
    class Demo:
        """Demo.

        Attributes:
            a / b: Shared text
                continued here.
            c: Own text.

        Raises:
            ValueError: never.
        """

        a: int = 0
        b: int = 0
        c: int = 0

    assert attribute_docs(Demo) == {
        "a": "Shared text continued here.",
        "b": "Shared text continued here.",
        "c": "Own text.",
    }


def test_an_undocumented_key_is_an_error() -> None:
    @dataclasses.dataclass
    class Bare:
        """No attributes."""

        x: int = 0

    (key,) = config_keys(Bare, "bare")
    with pytest.raises(ValueError, match=r"Bare.x has no entry in an Attributes: section"):
        key_doc(key)


def test_the_page_stands_alone() -> None:
    text = DOC_PATH.read_text()
    assert "../" not in text
    assert "issue" not in text.lower()
