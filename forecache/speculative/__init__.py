"""Exact speculative decoding (SP-MoE): the speculator that drafts, verifies and prefetches
(``speculator``), and the draft model's own llama.cpp context (``draft``)."""
