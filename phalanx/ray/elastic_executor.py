"""horovod.ray's ``ElasticRayExecutor``: an elastic :class:`~phalanx.ray.RayExecutor` configured the
way horovod.ray configures it (bounds in the settings; see :mod:`phalanx.ray.elastic_job` and docs/ray.md).

Example::

    from phalanx.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_np=1, max_np=4, elastic_timeout=60)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    executor.start()
    results = executor.run(train)          # train uses phalanx.elastic.run and a State
"""

from __future__ import annotations

from phalanx.ray.executor import RayExecutor, Settings

__all__ = ["ElasticRayExecutor"]


class ElasticRayExecutor(RayExecutor):
    """horovod.ray's ``ElasticRayExecutor``: the bounds come from ``create_settings(min_np=, max_np=)``.

    Example::

        settings = ElasticRayExecutor.create_settings(min_np=1, max_np=4, elastic_timeout=60)
        executor = ElasticRayExecutor(settings, cpus_per_slot=1)
        executor.start()
        results = executor.run(train)
    """

    @classmethod
    def create_settings(cls, min_np: int = 1, max_np: int | None = None, reset_limit: int | None = None,
                        elastic_timeout: float = 600, timeout_s: float = 30, ssh_identity_file: str | None = None,
                        nics=None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                        **_ignored) -> Settings:
        """horovod.ray's elastic settings (``min_num_proc``/``max_num_proc``: its older names)."""
        settings = RayExecutor.create_settings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file, nics=nics)
        settings.elastic = True
        settings.min_np, settings.max_np = min_num_proc or min_np, max_num_proc or max_np
        settings.reset_limit, settings.elastic_timeout = reset_limit, elastic_timeout
        return settings

    def __init__(self, settings: Settings | None = None, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float | None = None, env_vars: dict | None = None, override_discovery: bool = True,
                 cpus_per_worker: float | None = None, gpus_per_worker: float | None = None) -> None:
        settings = settings or ElasticRayExecutor.create_settings()
        super().__init__(settings, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker or cpus_per_slot,
                         gpus_per_worker=gpus_per_worker or gpus_per_slot, min_workers=settings.min_np or 1,
                         max_workers=settings.max_np, reset_limit=settings.reset_limit,
                         elastic_timeout=settings.elastic_timeout, override_discovery=override_discovery)
        self.env_vars = dict(env_vars or {})

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None, extra_env_vars=None) -> None:
        super().start(executable_cls, executable_args, executable_kwargs, {**self.env_vars, **(extra_env_vars or {})})
