# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/samplers/test_non_finite_params.py, unchanged but for the plumbing: the imports
# point at tokenloom.
"""Tests that non-finite float values (NaN, Inf) are rejected by
SamplingParams validation, preventing them from propagating to GPU kernels.

Addresses advisory GHSA-7h4p-rffg-7823.
"""

import math

import pytest

from tokenloom import SamplingParams
from tokenloom.exceptions import VLLMValidationError


class TestNonFiniteTemperature:
    """Verify that NaN and Infinity temperature values are rejected."""

    @pytest.mark.parametrize(
        "value",
        [float("nan"), float("inf"), float("-inf"), math.nan, math.inf],
        ids=["nan", "inf", "-inf", "math.nan", "math.inf"],
    )
    def test_non_finite_temperature_rejected(self, value: float):
        with pytest.raises(VLLMValidationError, match="temperature"):
            SamplingParams(temperature=value)

    def test_finite_temperature_accepted(self):
        SamplingParams(temperature=0.0)
        SamplingParams(temperature=0.5)
        SamplingParams(temperature=1.0)
        SamplingParams(temperature=2.0)


class TestNonFiniteRepetitionPenalty:
    """Verify that NaN and Infinity repetition_penalty values are rejected."""

    @pytest.mark.parametrize(
        "value",
        [float("nan"), float("inf"), float("-inf"), math.nan, math.inf],
        ids=["nan", "inf", "-inf", "math.nan", "math.inf"],
    )
    def test_non_finite_repetition_penalty_rejected(self, value: float):
        with pytest.raises(VLLMValidationError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=value)

    def test_finite_repetition_penalty_accepted(self):
        SamplingParams(repetition_penalty=0.5)
        SamplingParams(repetition_penalty=1.0)
        SamplingParams(repetition_penalty=2.0)
