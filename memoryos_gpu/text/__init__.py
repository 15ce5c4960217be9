"""Text utilities: LLM-free keyword extraction and stable keyword hashing."""

from memoryos_gpu.text.keywords import (
    PAD_ID,
    STOPWORDS,
    KeywordExtractor,
    extract_yake,
    hash_keyword,
    hash_keywords,
    jaccard,
    jaccard_ids,
    keyword_tokens,
    normalize_word,
    pack_keywords,
    tokenize,
    unpack_keywords,
    yake_available,
)

__all__ = [
    "PAD_ID",
    "STOPWORDS",
    "KeywordExtractor",
    "extract_yake",
    "hash_keyword",
    "hash_keywords",
    "jaccard",
    "jaccard_ids",
    "keyword_tokens",
    "normalize_word",
    "pack_keywords",
    "tokenize",
    "unpack_keywords",
    "yake_available",
]
