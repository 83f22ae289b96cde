"""The caps on every list and string a client chooses, in one place.

`SamplingParams` (runtime) and the request parser (app/protocol.py) enforce them;
app/openapi.py publishes them. Each bounds the work one request can make the server do.
"""

from __future__ import annotations

MAX_N = 16  # choices per prompt
MAX_TOP_LOGPROBS = 20  # top-logprob entries per token
MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_CHARS = 4096  # their total length in characters
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
MAX_LOGIT_BIAS = 300  # entries in one logit_bias map (OpenAI's limit)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_SEQUENCES = 128  # prompts x n in one request
MAX_MESSAGES = 2048  # messages in one chat request
MAX_CONTENT_PARTS = 256  # content parts in one message
MAX_NAME_CHARS = 256  # messages[].name
MAX_METADATA_PAIRS = 16  # metadata: string keys to string values (OpenAI's shape)
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
