"""User ids that print alike must be one id: a page is written only under an id in NFC without
invisible characters, while a store that holds such an id keeps finding it."""

from __future__ import annotations

from typing import Any

import pytest

from memoryos_gpu.engine import InvalidInputError, validate_page
from memoryos_gpu.engine import validation as v
from memoryos_gpu.errors import UnknownUserError
from memoryos_gpu.types import PageInput

_NFD_ZOE = "Zoe\u0308"  # "Zoë" with a combining diaeresis: prints as "Zo\u00eb"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("user_id", _NFD_ZOE, "NFC"),
        ("user_id", "ali\u200bce", "invisible"),  # zero width space
        ("user_id", "alice\u202e", "invisible"),  # right-to-left override
        ("user_id", "a\u2028b", "line-separator"),
        ("assistant_id", "bot\u200d", "invisible"),  # zero width joiner
        ("assistant_id", "Cafe\u0301", "NFC"),
    ],
)
def test_ids_that_print_like_another_are_refused_at_write(
    field: str, value: str, match: str
) -> None:
    page = PageInput(**{"user_id": "u", "user_input": "hi", "agent_response": "", field: value})
    with pytest.raises(InvalidInputError, match=match):
        validate_page(page)


def test_visible_nfc_ids_and_any_source_pass_unchanged() -> None:
    page = validate_page(
        PageInput("Zo\u00eb", "Cafe\u0301", "", 1.7e9, "b\u00f8t", f"{_NFD_ZOE}.jsonl:1", {})
    )
    assert (page.user_id, page.assistant_id) == ("Zo\u00eb", "b\u00f8t")
    assert page.source == f"{_NFD_ZOE}.jsonl:1"  # a file name's key: checked, never refused
    assert page.user_input == "Caf\u00e9"  # texts are NFC-normalised, ids never rewritten


def test_nfd_and_nfc_spellings_are_not_two_users(make_engine: Any) -> None:
    e = make_engine(mode="extractive")
    e.add("Zo\u00eb", "I like tea", "ok")
    with pytest.raises(InvalidInputError, match="NFC"):
        e.add(_NFD_ZOE, "I like coffee", "ok")
    assert e.users() == ["Zo\u00eb"]


def test_a_user_an_older_store_holds_under_such_an_id_stays_readable(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads, exports and deletes check ids leniently: an id written before the rule (made
    here by writing with the old, lenient check) is still found by the id as given."""
    e = make_engine(mode="extractive")
    with monkeypatch.context() as m:
        m.setattr(v, "_new_identity", v._clean_id)
        e.add(_NFD_ZOE, "I keep bees", "ok")
        e.add("ali\u200bce", "I like jazz", "ok")
    for uid in (_NFD_ZOE, "ali\u200bce"):
        assert e.retrieve(uid, "what do I do?").user_id == uid
        assert e.export_user(uid)["pages"][0]["agent_response"] == "ok"
        assert e.delete_user(uid) is True
        with pytest.raises(UnknownUserError):
            e.retrieve(uid, "anything left?")
