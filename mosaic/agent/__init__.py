"""The agent side: policies, chat format, tokenizer, the multi-session harness, the scripted expert.

Light to import (no torch / transformers at import time)::

    from mosaic.agent import Harness, HarnessConfig, ChatFormat, DeepSearchEnv, ExpertPolicy
"""

from mosaic.agent.chat import ChatFormat, PrefixPreservationError
from mosaic.agent.expert import ExpertNoise, ExpertPolicy
from mosaic.agent.harness import MODES, DeepSearchEnv, Harness, HarnessConfig
from mosaic.agent.policy import GenRequest, GenResult, Policy
from mosaic.agent.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

__all__ = [
    "ChatFormat", "PrefixPreservationError", "ExpertNoise", "ExpertPolicy", "MODES", "DeepSearchEnv",
    "Harness", "HarnessConfig", "GenRequest", "GenResult", "Policy", "load_tokenizer", "save_tokenizer",
    "train_tokenizer",
]
