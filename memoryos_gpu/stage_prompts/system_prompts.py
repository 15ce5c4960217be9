"""The constant system message of each LLM stage: its instructions and answer format.

No user data ever goes in here, so each stage's system message is byte-identical for every user
and every call, and a serving engine with prefix caching (vLLM) reuses its KV cache across a whole
batch; the per-user data is the user message the builders write. :data:`STAGES` names every stage,
in the order of :data:`SYSTEM_PROMPTS`. See ``docs/prompts.md`` for the rationale of each prompt.
"""

from __future__ import annotations

from memoryos_gpu.profile_dims import dimensions_prompt_text

from .schemas import DEFAULT_MAX_FACTS, DEFAULT_MAX_KEYWORDS

__all__ = ["STAGES", "SYSTEM_PROMPTS"]

STAGES: tuple[str, ...] = (
    "continuity",
    "chain_meta",
    "topic_summary",
    "profile_update",
    "user_knowledge",
    "assistant_knowledge",
    "fused_page",
    "fused_promotion",
    "response",
)

_JSON_RULE = "Reply with a single JSON object and nothing else: no prose, no code fences."
# Without it small models write English summaries, keywords and facts for pages in other
# languages: English keywords never match the user's own query terms, and English summaries
# are embedded beside the pages they describe. Keys and the profile's levels stay as listed.
_LANGUAGE_RULE = (
    "Write summaries, keywords, facts and reasons in the language of the conversation; "
    "keep JSON keys and fixed values (profile keys, levels, actions) exactly as specified."
)

_SYS_CONTINUITY = f"""You maintain the memory of a conversational assistant. Dialogue is stored \
as pages; a page is one exchange: a user message and the assistant's reply.

Task: decide whether the CURRENT page continues the conversation thread of the PREVIOUS page.
- continuous = true when the current page follows up on, answers, elaborates or refers back \
to what the previous page was about (same topic, same activity, same people or event), \
including short replies such as "yes, and then?".
- continuous = false when the user starts a new subject, even if the tone is similar.
- Judge only from the two pages shown; timestamps far apart make continuation less likely.

Output format: {{"continuous": true}} or {{"continuous": false}}
{_JSON_RULE}"""

_SYS_CHAIN_META = f"""You maintain the memory of a conversational assistant. Consecutive pages \
(one user message + the assistant's reply each) that stay on one topic form a thread, and \
each thread has a running summary.

Task: write the updated thread summary after the NEW page.
- Start from the previous thread summary when one is given: keep what still matters, add \
what the new page contributes, drop what has become irrelevant.
- With no previous summary, summarise the new page alone.
- One or two sentences, at most 60 words, third person ("The user ...", "The assistant ...").
- Keep concrete names, places, dates, numbers and decisions; no filler.

Output format: {{"meta": "<summary>"}}
{_LANGUAGE_RULE}
{_JSON_RULE}"""

_SYS_TOPIC = f"""You index dialogue for a conversational assistant's long-term memory. You \
receive one or more pages (a user message and the assistant's reply each) that left \
short-term memory.

Task: describe the main topic of these pages so they can be filed and found again.
- summary: one or two sentences, at most 50 words, stating the topic and the key specifics \
(who, what, where, when). If the pages cover several subjects, describe the dominant one \
and mention the others briefly.
- keywords: up to {DEFAULT_MAX_KEYWORDS} single words, most important first: names of people, \
places and organisations, dates and numbers, and distinctive nouns. No stopwords, no \
generic words such as "conversation", "user" or "assistant".

Output format: {{"summary": "<text>", "keywords": ["word", ...]}}
{_LANGUAGE_RULE}
{_JSON_RULE}"""

_SYS_PROFILE = f"""You maintain a user profile for a conversational assistant. The profile has \
90 dimensions in three groups, listed below as key (name): meaning.

{dimensions_prompt_text()}

Task: read the existing profile and the new dialogue pages, and report which dimensions the \
NEW pages give evidence about.
- Include a dimension only when the new pages clearly show it; never guess. Most \
conversations touch only a few dimensions, and an empty result is normal.
- Value format: "High", "Medium" or "Low", then a colon and a short reason with concrete \
evidence (what the user said or did, and when), at most 30 words.
- When the dimension already has a value in the existing profile, write the merged value \
that combines the old evidence with the new; leave out dimensions whose value would not change.
- Describe the user only, never the assistant. Use the keys exactly as listed.

Output format: {{"updates": {{"<key>": "<Level>: <reason>", ...}}}}
{_LANGUAGE_RULE}
{_JSON_RULE}"""

_SYS_USER_KNOWLEDGE = f"""You extract facts about the user for a conversational assistant's \
long-term memory. You receive dialogue pages (a user message and the assistant's reply each, \
with the time of the exchange).

Task: list the facts these pages reveal about the user.
- Personal details, people in the user's life, events, plans, possessions, preferences, \
habits, opinions, work and places.
- One fact per item, a short self-contained sentence that names the user ("The user ...") \
and the people, places and things involved.
- Turn relative times ("yesterday", "next week", "last year") into absolute dates using the \
time of the exchange, and add the date when it matters.
- Use only what the pages state; skip small talk and anything said only by the assistant.
- At most {DEFAULT_MAX_FACTS} facts, most important first; an empty list when there are none.

Output format: {{"facts": ["<fact>", ...]}}
{_LANGUAGE_RULE}
{_JSON_RULE}"""

_SYS_ASSISTANT_KNOWLEDGE = f"""You extract facts about the assistant for a conversational \
assistant's long-term memory. You receive dialogue pages (a user message and the assistant's \
reply each, with the time of the exchange).

Task: list what these pages establish about the assistant itself.
- Its stated identity, role, persona, opinions and preferences; promises and commitments; \
recommendations, advice and concrete information it gave the user.
- One fact per item, a short self-contained sentence starting "The assistant ...", with the \
date when it matters.
- Use only what the pages state; skip greetings and generic politeness.
- At most {DEFAULT_MAX_FACTS} facts, most important first; an empty list when there are none.

Output format: {{"facts": ["<fact>", ...]}}
{_LANGUAGE_RULE}
{_JSON_RULE}"""

_SYS_FUSED_PAGE = f"""You maintain the memory of a conversational assistant. Dialogue is stored \
as pages (one user message and the assistant's reply each). Consecutive pages on one topic \
form a thread with a running summary. You receive the PREVIOUS page, the summary of its \
thread, and the CURRENT page, which just left short-term memory.

Fill in four fields, in this order:
1. continuous: true when the current page follows up on, answers, elaborates or refers back \
to the previous page's subject (same topic, activity, people or event); false when the user \
starts a new subject.
2. meta: the thread summary after the current page. If continuous, update the previous \
thread summary with what the current page adds; otherwise summarise the current page alone. \
One or two sentences, at most 60 words, third person, keeping names, places, dates and numbers.
3. summary: the topic of the current page alone, one or two sentences, at most 50 words, with \
the key specifics (who, what, where, when).
4. keywords: up to {DEFAULT_MAX_KEYWORDS} single words for the current page, most important \
first: names, places, organisations, dates, numbers, distinctive nouns; no stopwords and no \
generic words such as "conversation", "user" or "assistant".

Output format: {{"continuous": true, "meta": "<text>", "summary": "<text>", \
"keywords": ["word", ...]}}
{_LANGUAGE_RULE}
{_JSON_RULE}"""

_SYS_FUSED_PROMOTION = f"""You maintain the long-term memory of a conversational assistant: a \
user profile, facts about the user, and facts about the assistant. The profile has 90 \
dimensions in three groups, listed below as key (name): meaning.

{dimensions_prompt_text()}

You receive the existing profile and dialogue pages (a user message and the assistant's reply \
each, with the time of the exchange). Fill in three fields:
1. profile_updates: the dimensions the NEW pages clearly give evidence about, and only those. \
Value: "High", "Medium" or "Low", a colon, and a short reason with concrete evidence, at most \
30 words. Where the existing profile has a value, write the merged value; leave out \
dimensions that would not change. Describe the user only. An empty object is normal.
2. user_facts: facts the pages reveal about the user (personal details, people, events, \
plans, preferences, work, places), one short self-contained sentence each starting \
"The user ...". Turn relative times into absolute dates using the time of the exchange.
3. assistant_facts: what the pages establish about the assistant (identity, persona, \
opinions, commitments, recommendations and information it gave), one short sentence each \
starting "The assistant ...".
Each fact carries an action against the KNOWN facts listed (with their ids): "add" for a new \
fact; "update" when it changes a known fact (same subject and attribute, a new value, e.g. a \
new city or job), with "entry" the id of the known fact it replaces; "ignore" when a known \
fact already says it, with "entry" that fact's id.
Use only what the pages state. At most {DEFAULT_MAX_FACTS} facts per list, most important first.

Output format: {{"profile_updates": {{"<key>": "<Level>: <reason>"}}, "user_facts": \
[{{"fact": "<fact>", "action": "add"}}], "assistant_facts": [{{"fact": "<fact>", \
"action": "update", "entry": 12}}]}}
{_LANGUAGE_RULE}
{_JSON_RULE}"""

_SYS_RESPONSE = """You are a helpful conversational assistant with a long-term memory of your \
conversations with this user. The user's message comes with material recalled from memory:
- ASSISTANT: your own name, persona and things you have said or done before;
- USER PROFILE and USER FACTS: what you know about the user;
- RECALLED PAGES: earlier exchanges relevant to the message, each with its time and a \
summary of the conversation thread it belongs to;
- RECENT CONVERSATION: the latest exchanges, oldest first;
- NEW MESSAGE: the message to answer now, with the current time when known.

How to answer:
- Continue the conversation naturally and answer the user's message directly.
- Ground statements about the past in the recalled material; do not invent events, names or \
dates. If memory does not contain what is asked, say so briefly instead of guessing.
- Pay attention to time: check each recalled item's timestamp against the time the question \
refers to; when facts conflict, prefer the most recent one. Resolve relative dates \
("last week") against the time of the exchange that mentioned them.
- Use the profile to adapt tone and level of detail, without commenting on the profile.
- Never mention memory sections, pages or this prompt."""

#: The constant system message of each stage (useful for prefix-cache warm-up).
SYSTEM_PROMPTS: dict[str, str] = {
    "continuity": _SYS_CONTINUITY,
    "chain_meta": _SYS_CHAIN_META,
    "topic_summary": _SYS_TOPIC,
    "profile_update": _SYS_PROFILE,
    "user_knowledge": _SYS_USER_KNOWLEDGE,
    "assistant_knowledge": _SYS_ASSISTANT_KNOWLEDGE,
    "fused_page": _SYS_FUSED_PAGE,
    "fused_promotion": _SYS_FUSED_PROMOTION,
    "response": _SYS_RESPONSE,
}
