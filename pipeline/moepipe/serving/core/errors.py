"""The errors a ``tensorrt_llm`` model answers, with their Triton codes and texts.

Upstream's texts are verbatim so that clients see the same errors on every target:
TensorRT-LLM's C++ backend (NVIDIA/TensorRT-LLM ``triton_backend/inflight_batcher_llm/src/
utils.cc`` ``createRequestsFromInputTensors``; ``src/model_instance_state.cc``
``handleStopRequest``) - the trtllm-engine target answers with these - and Triton's queue
policy for busy refusals (triton-inference-server/core ``src/scheduler_utils.cc``
``PolicyQueue::Enqueue``: "Exceeds maximum queue size"; ``src/dynamic_batch_scheduler.cc``:
"Request timeout expired"). TensorRT-LLM's executor refuses a full queue with "Maximum queue
size of N has been reached, please try again later" (``cpp/tensorrt_llm/executor/
executorImpl.cpp`` ``enqueueRequests``).
"""

ERR_BATCH_NOT_DECOUPLED = ("Batch size > 1 requires the tensorrt_llm backend to be using "
                           "decoupled transaction policy")
# Upstream's Python tensorrt_llm model says "Streaming is only supported in decoupled mode.";
# the C++ backend's text is the one the trtllm-engine target answers, so it is every target's.
ERR_STREAMING_NOT_DECOUPLED = ("Streaming is only supported if model is deployed using "
                               "decoupled mode.")
ERR_STOP_WITHOUT_ID = "Trying to stop a request but request ID is not provided"
QUEUE_FULL = "Exceeds maximum queue size"
QUEUE_TIMEOUT = "Request timeout expired"
EXECUTOR_QUEUE_FULL = "has been reached, please try again later"
# A cpu rank group that lost a rank (moepipe.ranks.errors.RANK_GROUP_LOST, held equal by a
# test: the core imports nothing of moepipe): retry once the group is formed again.
RANK_GROUP_LOST = "rank group unavailable"
# Every text that says "busy, retry later", whoever wrote it.
BUSY_TEXTS = (QUEUE_FULL, QUEUE_TIMEOUT, EXECUTOR_QUEUE_FULL, RANK_GROUP_LOST)


class RequestError(ValueError):
    """A request the client can fix: answered as INVALID_ARG (HTTP 400)."""

    triton_code = "INVALID_ARG"


class Busy(RuntimeError):
    """A request shed because the server is at capacity: answered as UNAVAILABLE (HTTP 503
    where the protocol carries a status)."""

    triton_code = "UNAVAILABLE"


def is_busy(message: str) -> bool:
    """Whether an error message is a busy refusal (its code may have been lost on the way:
    the Python backend hands a BLS model every error as INTERNAL)."""
    return any(text in message for text in BUSY_TEXTS)


def triton_code(error: BaseException) -> str:
    """The name of the ``pb_utils.TritonError`` code an exception is answered with: the
    class's own (``RequestError``, ``Busy``, also from another copy of this package),
    INVALID_ARG for any other ValueError, INTERNAL for the rest."""
    code = getattr(type(error), "triton_code", None)
    if code is not None:
        return code
    return "INVALID_ARG" if isinstance(error, ValueError) else "INTERNAL"
