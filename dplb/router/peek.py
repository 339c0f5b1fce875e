"""The request-body fields the router reads (msgspec Structs and their JSON decoders); every other field stays
opaque in the forwarded bytes.

Contract
- :class:`Peek`: what routing, the tenant gate and the quota read of a JSON body (:func:`dplb.router.intake.read_body`
  decodes it once, with :data:`peek_decoder`); :data:`NO_PEEK` for a body that is not JSON.
- :class:`ResumeFields`: the fields that decide whether a stream can be resumed (:mod:`dplb.router.resume`, decoded
  with :data:`resume_fields`).
- Never compiled (not in :data:`dplb.native.HOT_MODULES`), unlike the modules that use these classes: a class
  compiled by mypyc keeps erased annotations (``Any`` becomes ``type``, which msgspec would then demand). Decoding
  is msgspec's C code either way.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Peek(msgspec.Struct):
    """The only fields the router reads; everything else stays opaque in the forwarded bytes."""

    stream: Any = False
    model: Any = None
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    input: msgspec.Raw = msgspec.Raw(b"")
    previous_response_id: Any = None
    request_id: Any = None
    # The output limit (chat / completions / Responses API names): a tenant's token quota reserves it at admission.
    max_tokens: Any = None
    max_completion_tokens: Any = None
    max_output_tokens: Any = None
    # How many sequences the engine generates (OpenAI/vLLM ``n``; vLLM completions' ``best_of``): the quota reserves
    # the output limit once per sequence.
    n: Any = None
    best_of: Any = None


#: The peek of a body that is not JSON (no field read).
NO_PEEK = Peek()
#: Decodes a JSON body into a :class:`Peek`: ``msgspec.ValidationError`` when it is not an object,
#: ``msgspec.DecodeError`` when it is not JSON.
peek_decoder = msgspec.json.Decoder(Peek)


class ResumeFields(msgspec.Struct):
    """The request fields that decide whether a stream can be resumed (:mod:`dplb.router.resume`; everything else
    stays opaque)."""

    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    prompt_logprobs: Any = None
    echo: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    tools: Any = None
    tool_choice: Any = None
    continue_final_message: Any = None
    prompt: Any = None
    stream_options: Any = None


#: Decodes a request body into :class:`ResumeFields`.
resume_fields = msgspec.json.Decoder(ResumeFields)

__all__ = ["NO_PEEK", "Peek", "ResumeFields", "peek_decoder", "resume_fields"]
