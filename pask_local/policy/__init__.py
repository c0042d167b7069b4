"""Persistence policies: the policy file (schema), the budget compile step, shipped policies."""

from .compile import CompiledPolicy, compile_policy
from .schema import Policy, PolicyError, contiguous_groups

__all__ = ["CompiledPolicy", "Policy", "PolicyError", "compile_policy", "contiguous_groups"]
