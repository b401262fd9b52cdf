"""--moe-expert-capacity-factor: which (token, choice) pairs an expert keeps, by each drop policy."""

import torch

from megatron_slapo.plans.expert_capacity import kept

# 4 tokens, top-2 over 3 experts: expert 0 is chosen 3 times, expert 1 three times, expert 2 twice
INDEX = torch.tensor([[0, 1], [0, 2], [1, 0], [2, 1]])
WEIGHTS = torch.tensor([[0.2, 0.8], [0.9, 0.1], [0.6, 0.4], [0.7, 0.3]])


def test_each_expert_keeps_its_pairs_of_highest_weight_up_to_capacity():
    keep = kept(INDEX, WEIGHTS, experts=3, capacity=2, policy="probs")
    # expert 0: weights 0.2, 0.9, 0.4 -> drops 0.2; expert 1: 0.8, 0.6, 0.3 -> drops 0.3; expert 2: both kept
    assert keep.tolist() == [[False, True], [True, True], [True, True], [True, False]]


def test_the_position_policy_keeps_the_first_tokens():
    keep = kept(INDEX, WEIGHTS, experts=3, capacity=2, policy="position")
    assert keep.tolist() == [[True, True], [True, True], [True, False], [True, False]]


def test_a_capacity_as_large_as_the_pairs_drops_nothing():
    assert kept(INDEX, WEIGHTS, experts=3, capacity=8, policy="probs").all()
