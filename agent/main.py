"""``ftsystem agent``: supervise one replica until it finishes."""

from __future__ import annotations

import asyncio
import logging

from agent.supervisor import Agent, AgentConfig
from ftsystem.measure import metrics


def run_agent(cfg: AgentConfig) -> int:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s agent[{cfg.replica_id}/"
                               f"{'spare' if cfg.node_rank is None else cfg.node_rank}] %(message)s")
    metrics.init_agent(cfg.job, cfg.replica_id)
    return asyncio.run(Agent(cfg).run())
