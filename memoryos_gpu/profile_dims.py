"""The user-profile trait dimensions of MemoryOS (90 dimensions in 3 groups).

The paper (arXiv 2506.06326) describes the long-term user profile as 90 trait
dimensions in three groups: basic needs and personality, AI-alignment
dimensions, and content-platform interest tags. The reference code only spells
out about half of them in its prompt, so this module fixes a complete list of
its own: the groups follow the paper, the names follow the reference where it
has one, the rest are added in the same spirit, and all descriptions are this
project's own wording.

Keys are stable snake_case identifiers: they are the property names of the
profile-update JSON schema and the keys of the stored profile, so never rename
one (add new dimensions at the end of a group instead, and bump
``PROFILE_DIMS_VERSION``).

A profile is a plain ``dict[str, str]`` mapping a dimension key to a short
free-text value, conventionally ``"High|Medium|Low: reason"``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DIMENSIONS",
    "DIMENSIONS_BY_KEY",
    "DIMENSION_KEYS",
    "GROUPS",
    "PROFILE_DIMS_VERSION",
    "ProfileDimension",
    "ProfileGroup",
    "dimensions_prompt_text",
    "normalize_dimension_key",
    "render_profile",
]

PROFILE_DIMS_VERSION = 1


@dataclass(frozen=True)
class ProfileDimension:
    key: str
    name: str
    description: str
    group: str


@dataclass(frozen=True)
class ProfileGroup:
    key: str
    name: str
    description: str
    dimensions: tuple[ProfileDimension, ...]


def _group(key: str, name: str, description: str, rows: list[tuple[str, str, str]]):
    dims = tuple(ProfileDimension(k, n, d, key) for k, n, d in rows)
    return ProfileGroup(key, name, description, dims)


_BASIC = _group(
    "basic_needs_personality",
    "Basic needs and personality",
    "Stable traits and motivations of the user as a person.",
    [
        ("extraversion", "Extraversion", "Draws energy from company and social activity."),
        ("openness", "Openness", "Welcomes new ideas, experiences and viewpoints."),
        ("agreeableness", "Agreeableness", "Tends to be warm, cooperative and accommodating."),
        ("conscientiousness", "Conscientiousness", "Organised, dependable, follows through."),
        ("neuroticism", "Neuroticism", "Prone to worry, stress or mood swings."),
        (
            "physiological_needs",
            "Physiological needs",
            "Attention to sleep, food, rest and comfort.",
        ),
        ("need_for_security", "Need for security", "Values safety, stability and predictability."),
        ("need_for_belonging", "Need for belonging", "Wants to be part of a group or community."),
        ("need_for_self_esteem", "Need for self-esteem", "Seeks respect, recognition and status."),
        (
            "cognitive_needs",
            "Cognitive needs",
            "Wants to learn, understand and make sense of things.",
        ),
        ("aesthetic_appreciation", "Aesthetic appreciation", "Moved by beauty, design and art."),
        (
            "self_actualization",
            "Self-actualization",
            "Strives to grow and realise personal potential.",
        ),
        ("need_for_order", "Need for order", "Likes tidiness, structure and routines."),
        ("need_for_autonomy", "Need for autonomy", "Prefers deciding and acting independently."),
        ("need_for_power", "Need for power", "Wants influence or control over people or outcomes."),
        ("need_for_achievement", "Need for achievement", "Driven by goals and accomplishments."),
        ("need_for_novelty", "Need for novelty", "Seeks variety, change and fresh stimulation."),
        ("need_for_play", "Need for play", "Makes room for fun, leisure and relaxation."),
        ("need_for_nurturance", "Need for nurturance", "Enjoys caring for and helping others."),
        (
            "need_for_intimacy",
            "Need for intimacy",
            "Values close, trusting personal relationships.",
        ),
        ("risk_tolerance", "Risk tolerance", "Comfort with uncertainty and bold choices."),
        ("optimism", "Optimism", "Expects good outcomes and sees the bright side."),
        ("patience", "Patience", "Stays calm with delays, slow progress or setbacks."),
        ("competitiveness", "Competitiveness", "Motivated by winning or outperforming others."),
        ("empathy", "Empathy", "Picks up on and shares other people's feelings."),
        (
            "emotional_resilience",
            "Emotional resilience",
            "Recovers quickly from stress or disappointment.",
        ),
        ("spontaneity", "Spontaneity", "Acts on impulse rather than careful planning."),
        ("assertiveness", "Assertiveness", "States needs and opinions directly and confidently."),
        ("altruism", "Altruism", "Puts others' welfare ahead of personal gain."),
        ("introspection", "Introspection", "Reflects on own thoughts, motives and feelings."),
    ],
)

_ALIGNMENT = _group(
    "ai_alignment",
    "AI alignment dimensions",
    "What the user expects from the assistant's answers and manner.",
    [
        ("helpfulness", "Helpfulness", "Expects answers that actually solve the problem at hand."),
        ("honesty", "Honesty", "Expects candour, including admitting uncertainty or limits."),
        ("safety", "Safety", "Wants sensitive, risky or harmful content avoided."),
        (
            "instruction_compliance",
            "Instruction compliance",
            "Wants instructions followed exactly.",
        ),
        ("truthfulness", "Truthfulness", "Cares that stated facts are accurate and verifiable."),
        ("coherence", "Coherence", "Values clear, logically ordered explanations."),
        ("complexity", "Complexity", "Welcomes detailed, in-depth or technical content."),
        ("conciseness", "Conciseness", "Prefers short, to-the-point replies."),
        ("transparency", "Transparency", "Wants the reasoning or steps behind an answer shown."),
        ("source_citation", "Source citation", "Likes references, links or evidence for claims."),
        (
            "privacy_sensitivity",
            "Privacy sensitivity",
            "Careful about sharing or storing personal data.",
        ),
        (
            "personalization",
            "Personalization",
            "Wants replies tailored to personal situation and history.",
        ),
        ("proactivity", "Proactivity", "Appreciates unprompted suggestions and next steps."),
        (
            "emotional_support",
            "Emotional support",
            "Looks to the assistant for comfort or encouragement.",
        ),
        ("language_style", "Language style", "Formal versus casual tone preferred."),
        (
            "sense_of_humor",
            "Sense of humor",
            "Enjoys playful, witty replies versus strictly serious ones.",
        ),
        (
            "emotional_expression",
            "Emotional expression",
            "Expresses feelings openly versus with restraint.",
        ),
        (
            "information_density",
            "Information density",
            "Dense, information-packed versus light replies.",
        ),
        ("practicality", "Practicality", "Actionable advice over theory and abstraction."),
        (
            "structured_formatting",
            "Structured formatting",
            "Likes lists, steps and headings in replies.",
        ),
    ],
)

_INTERESTS = _group(
    "interest_tags",
    "Content-platform interest tags",
    "Topics the user engages with or cares about.",
    [
        ("science_interest", "Science", "Follows scientific topics and discoveries."),
        ("education_interest", "Education", "Cares about learning, schooling and teaching."),
        ("psychology_interest", "Psychology", "Curious about the mind and behaviour."),
        ("family_concern", "Family", "Focused on family life, partners and children."),
        ("fashion_interest", "Fashion", "Into clothing, style and trends."),
        ("art_interest", "Art", "Makes or enjoys visual art."),
        ("health_concern", "Health", "Attentive to physical health, diet and lifestyle."),
        ("financial_management_interest", "Personal finance", "Budgeting, saving and investing."),
        ("sports_interest", "Sports", "Plays or follows sports and exercise."),
        ("food_interest", "Food", "Cooking, recipes, restaurants and cuisine."),
        ("travel_interest", "Travel", "Trips, destinations and exploring new places."),
        ("music_interest", "Music", "Listens to, plays or creates music."),
        ("literature_interest", "Literature", "Books, reading and authors."),
        ("film_interest", "Film", "Movies and cinema."),
        (
            "social_media_activity",
            "Social media",
            "How actively the user posts and follows online.",
        ),
        ("tech_interest", "Technology", "Gadgets, software and innovation."),
        ("environmental_concern", "Environment", "Climate, sustainability and nature protection."),
        ("history_interest", "History", "Past events, eras and heritage."),
        ("political_concern", "Politics", "Political and social issues."),
        (
            "religious_interest",
            "Religion and spirituality",
            "Faith, belief and spiritual practice.",
        ),
        ("gaming_interest", "Gaming", "Video games or board games."),
        ("animal_concern", "Animals and pets", "Pets, wildlife and animal welfare."),
        ("career_interest", "Career", "Work, job changes and professional growth."),
        ("entrepreneurship_interest", "Business", "Starting or running a business."),
        ("photography_interest", "Photography", "Taking or editing photos."),
        ("automotive_interest", "Cars and vehicles", "Cars, motorbikes and driving."),
        ("home_garden_interest", "Home and garden", "Decorating, gardening and home improvement."),
        (
            "crafts_interest",
            "Crafts and DIY",
            "Handmade projects, knitting, woodworking and making.",
        ),
        ("beauty_interest", "Beauty", "Skincare, make-up and grooming."),
        ("relationships_interest", "Relationships", "Dating, friendship and relationship advice."),
        ("language_learning_interest", "Languages", "Learning or using foreign languages."),
        ("philosophy_interest", "Philosophy", "Ideas about meaning, ethics and knowledge."),
        ("outdoor_interest", "Outdoors", "Hiking, camping and time in nature."),
        ("tv_series_interest", "TV series", "Television shows and streaming series."),
        ("anime_comics_interest", "Anime and comics", "Anime, manga and comic books."),
        ("volunteering_interest", "Volunteering", "Charity work and community service."),
        ("shopping_interest", "Shopping", "Buying things, deals and product comparison."),
        ("astronomy_interest", "Astronomy and space", "Stars, planets and space exploration."),
        ("writing_interest", "Creative writing", "Writing stories, poems or blogs."),
        ("performing_arts_interest", "Performing arts", "Theatre, dance and live performance."),
    ],
)

#: The three groups, in prompt order.
GROUPS: tuple[ProfileGroup, ...] = (_BASIC, _ALIGNMENT, _INTERESTS)
#: All 90 dimensions, in prompt order.
DIMENSIONS: tuple[ProfileDimension, ...] = tuple(d for g in GROUPS for d in g.dimensions)
#: All 90 keys, in prompt order.
DIMENSION_KEYS: tuple[str, ...] = tuple(d.key for d in DIMENSIONS)
DIMENSIONS_BY_KEY: dict[str, ProfileDimension] = {d.key: d for d in DIMENSIONS}

_ALIASES: dict[str, str] = {}
for _d in DIMENSIONS:
    for _alias in (_d.key, _d.name):
        _ALIASES[re.sub(r"[^a-z0-9]+", "_", _alias.lower()).strip("_")] = _d.key


def normalize_dimension_key(name: str) -> str | None:
    """Map a key or display name ("Need for Security", "need-for-security") to its key.

    Returns ``None`` for anything that is not one of the 90 dimensions.
    """
    if not isinstance(name, str):
        return None
    k = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return _ALIASES.get(k)


def dimensions_prompt_text() -> str:
    """The 90 dimensions as prompt text (``key (Name): description``), by group."""
    parts: list[str] = []
    for g in GROUPS:
        parts.append(f"[{g.name}] {g.description}")
        parts.extend(f"- {d.key} ({d.name}): {d.description}" for d in g.dimensions)
        parts.append("")
    return "\n".join(parts).rstrip()


def render_profile(
    profile: Mapping[str, object] | None,
    *,
    include_unknown: bool = False,
    empty_text: str = "",
) -> str:
    """Render a profile dict ``{key: value}`` as prompt text, grouped.

    Dimensions with an empty / ``None`` value are skipped, and so are groups with
    no filled dimension. Keys may be given as display names too. Keys that are
    not profile dimensions are dropped unless ``include_unknown``, in which case
    they are listed under "Other". Returns ``empty_text`` when nothing is left.
    """
    if not profile:
        return empty_text
    known: dict[str, str] = {}
    unknown: list[tuple[str, str]] = []
    for raw_key, raw_value in profile.items():
        if raw_value is None:
            continue
        value = " ".join(str(raw_value).split())
        if not value:
            continue
        key = normalize_dimension_key(str(raw_key))
        if key is None:
            if include_unknown:
                unknown.append((str(raw_key), value))
            continue
        known[key] = value
    parts: list[str] = []
    for g in GROUPS:
        lines = [f"- {d.name}: {known[d.key]}" for d in g.dimensions if d.key in known]
        if lines:
            parts.append(f"{g.name}:")
            parts.extend(lines)
    if unknown:
        parts.append("Other:")
        parts.extend(f"- {k}: {v}" for k, v in unknown)
    return "\n".join(parts) if parts else empty_text
