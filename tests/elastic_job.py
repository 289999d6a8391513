"""The training job the elastic tests run: its data, model and step as worker-script text, and the
same job in one process as the reference the workers' final parameters must equal."""

import textwrap

from phalanx import elastic

# Pasted into a worker script that defines TOTAL, G, N_DATA and imports torch and phalanx as px.
# step(..., batch) takes this rank's batch as set by a world-change hook (default G // n).
HELPERS = textwrap.dedent("""
    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N_DATA, 8, generator=g, dtype=torch.float64)
        return x, torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(model, opt, sampler, x, y, n, batch=None):
        batch = G // n if batch is None else batch  # the global batch G is split over the ranks there are
        if sampler.processed >= N_DATA - N_DATA % G:
            sampler.set_epoch(sampler.epoch + 1)
        idx = sampler.indices[:batch]
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        if n > 1:
            for p in model.parameters():
                px.allreduce(p.grad, op=px.Average, inplace=True)
        opt.step()
        sampler.record_batch(batch)
        sampler.reset()
""")


def reference(worker: str, total: int, n_data: int):
    """Run ``worker``'s own model/data/step for ``total`` steps in one process; return (params, model)."""
    ns = {}
    exec(compile(worker, "worker", "exec"), ns)
    model, opt = ns["make"]()
    x, y = ns["data"]()
    sampler = elastic.ElasticSampler(n_data, seed=1, rank=0, world_size=1)
    for _ in range(total):
        ns["step"](model, opt, sampler, x, y, 1)
    return [p.detach() for p in model.parameters()], model
