"""How a Zeus drop-in joins its job: `emit.init`, and training goes on without a coordinator.

Zeus's optimizers raise when they cannot do their work; a drop-in here only warns when the
coordinator is unreachable or the job is not registered, so training is never stopped by the
energy optimizer. A refusal (a bad argument, another user's job) still raises.
"""

from __future__ import annotations

import logging
from typing import Any

from zeus_agent import emit

__all__ = ["UNREACHABLE_CODES", "join_or_warn"]

UNREACHABLE_CODES = frozenset({"unavailable", "timeout"})
"""Reply codes that mean "no coordinator now", not "refused"."""


def join_or_warn(logger: logging.Logger, who: str, meanwhile: str,
                 **kwargs: Any) -> emit.Publisher:
    """`emit.init(**kwargs)`; an unreachable coordinator or an unregistered job only warns.

    Args:
        logger: The drop-in's logger (its warnings are the drop-in's).
        who: The drop-in, as its warnings name it.
        meanwhile: What training does without the coordinator ("continues ...").
        kwargs: `emit.init`'s arguments.

    Raises:
        zeus_agent.emit.RegistrationError: The coordinator refused the job or the rank.
    """
    try:
        publisher = emit.init(**kwargs)
    except emit.RegistrationError as e:
        if e.code not in UNREACHABLE_CODES:
            raise
        logger.warning("%s: the coordinator is unreachable (%s); training continues %s.", who,
                       e, meanwhile)
        publisher = emit.get_publisher()
    if publisher.job_id is None:
        logger.warning("%s: the job is not registered with a coordinator; training continues "
                       "%s.", who, meanwhile)
    return publisher
