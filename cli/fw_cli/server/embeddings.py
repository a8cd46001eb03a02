"""/v1/embeddings: OpenAI's embeddings API over the engine's pooling requests (fw.pooling), with vLLM's extras.

Each input runs as one pooling request, all admitted together so the scheduler batches them (with whatever
generation runs). ``encoding_format: base64`` sends each vector as OpenAI does: its float32 values, little-endian,
base64-encoded (the official client asks for that by default and decodes it).
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from fw.outputs import PoolingRequestOutput
from fw.pooling import PoolingParams
from fw_cli.server.protocol import EmbeddingRequest


def pooling_params(body: EmbeddingRequest) -> PoolingParams:
    return PoolingParams(dimensions=body.dimensions, normalize=body.normalize)


def _encode(vector: Any, encoding_format: str) -> list[float] | str:
    values = vector.tolist()  # float32 values, exact as Python floats
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def embedding_response(body: EmbeddingRequest, outputs: list[PoolingRequestOutput], model: str,
                       response_id: str) -> dict[str, Any]:
    """OpenAI's response: one ``embedding`` object per input, in order, and the prompt tokens as usage."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": _encode(out.outputs.data, body.encoding_format)}
                 for i, out in enumerate(outputs)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
