"""The JSON schema each LLM stage's answer must follow, for guided / structured decoding.

Deliberately simple (Draft 2020-12 compatible: objects, strings, booleans, arrays with
``maxItems``), with the properties in the order the model should write them. The canonical objects
are in :data:`SCHEMAS` (precompile grammars from there); the builders hand out a deep copy
(``_schema``). :data:`DEFAULT_MAX_KEYWORDS` and :data:`DEFAULT_MAX_FACTS` are the list sizes the
schemas, the system prompts, the parsers and the fallbacks agree on.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_MAX_FACTS", "DEFAULT_MAX_KEYWORDS", "FACT_ACTIONS", "SCHEMAS"]

Schema = dict[str, Any]

#: Keywords kept per topic summary.
DEFAULT_MAX_KEYWORDS = 8
#: Facts kept per knowledge extraction call.
DEFAULT_MAX_FACTS = 10


def _obj(properties: dict[str, Any], required: Sequence[str] | None = None) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


def _str_list(max_items: int) -> Schema:
    return {"type": "array", "items": {"type": "string"}, "maxItems": max_items}


def _fact_list(max_items: int) -> Schema:
    """Facts with a decision against the known entries shown (O-Mem's add / update / ignore):
    ``entry`` names the known entry an update replaces or an ignored fact repeats."""
    decided = _obj(
        {
            "fact": {"type": "string"},
            "action": {"type": "string", "enum": list(FACT_ACTIONS)},
            "entry": {"type": "integer"},
        },
        required=["fact", "action"],
    )
    # a bare string is an "add" (what models not shown known entries, and older prompts, answer)
    return {
        "type": "array",
        "items": {"anyOf": [decided, {"type": "string"}]},
        "maxItems": max_items,
    }


#: What a fused promotion may do with each fact, against the known entries it was shown.
FACT_ACTIONS = ("add", "update", "ignore")

# A map of dimension key -> text. The 90 keys are listed in the prompt, and the parser drops
# keys outside them; spelling them out as 90 schema properties made xgrammar's grammar
# compilation run for minutes on the CPU (measured), for no gain in what the parser accepts.
_PROFILE_UPDATES_SCHEMA: Schema = {
    "type": "object",
    "additionalProperties": {"type": "string"},
}

SCHEMAS: dict[str, Schema] = {
    "continuity": _obj({"continuous": {"type": "boolean"}}),
    "chain_meta": _obj({"meta": {"type": "string"}}),
    "topic_summary": _obj(
        {"summary": {"type": "string"}, "keywords": _str_list(DEFAULT_MAX_KEYWORDS)}
    ),
    "profile_update": _obj({"updates": _PROFILE_UPDATES_SCHEMA}),
    "user_knowledge": _obj({"facts": _str_list(DEFAULT_MAX_FACTS)}),
    "assistant_knowledge": _obj({"facts": _str_list(DEFAULT_MAX_FACTS)}),
    "fused_page": _obj(
        {
            "continuous": {"type": "boolean"},
            "meta": {"type": "string"},
            "summary": {"type": "string"},
            "keywords": _str_list(DEFAULT_MAX_KEYWORDS),
        }
    ),
    "fused_promotion": _obj(
        {
            "profile_updates": _PROFILE_UPDATES_SCHEMA,
            "user_facts": _fact_list(DEFAULT_MAX_FACTS),
            "assistant_facts": _fact_list(DEFAULT_MAX_FACTS),
        }
    ),
}


def _schema(stage: str) -> Schema:
    return copy.deepcopy(SCHEMAS[stage])
