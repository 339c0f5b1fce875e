"""Operator commands: ``dplb launch`` (:mod:`dplb.ops.launcher`, :mod:`dplb.ops.checks`, :mod:`dplb.ops.plan`),
``dplb doctor``, ``dplb state`` and the systemd unit environment (:mod:`dplb.ops.systemd_units`).

Layer rule: may import every layer below (router, worker, obs, policy, state, runtime); only :mod:`dplb.cli` and
:mod:`dplb.bench` import it.
"""
