"""Compute graph: symbolic tensors, ops with backward rules, autodiff, planner, layer builders."""
