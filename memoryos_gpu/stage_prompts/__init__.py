"""The LLM stages' prompts, answer schemas, parsers and LLM-free fallbacks, a module per concern.

Use them through :mod:`memoryos_gpu.prompts`: that module is the stages' API (its docstring and
``docs/prompts.md`` state the contract) and re-exports the public names of the modules here:

* ``rendering``: how a page (and any text) is shown in a prompt: truncation, timestamps,
  numbered pages;
* ``schemas``: the JSON schema of each stage's answer, and the list sizes it allows;
* ``system_prompts``: each stage's constant system message (its instructions);
* ``builders``: ``(messages, schema)`` of each stage, the per-user data in the user message;
* ``parsing``: a model's answer -> a typed, cleaned result, or ``None`` when unusable;
* ``fallbacks``: the result computed without an LLM when the call or its parse fails.

They are split this way because a stage's prompt is changed in one of these places at a time:
its wording (system prompt), its data (builder), its answer (schema and parser).
"""
