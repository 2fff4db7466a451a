"""Speculative decoding: proposers guess a decoding sequence's next tokens, the target model
verifies them all in the sequence's next step, and exact acceptance rules keep the output the
target's own (engine/spec/speculator.py has the flow)."""

from engine.spec.proposer import BaseProposer, Proposal
from engine.spec.speculator import SpecStepStats, Speculator

__all__ = ["BaseProposer", "Proposal", "SpecStepStats", "Speculator"]
