"""The elastic job's problem, shared with bench/recovery.py's torchft peer so both train the
same thing: a fixed regression dataset and a small model with its optimizer, seeded."""
import torch

SAMPLES, GLOBAL_BATCH = 96, 12


def make_problem():
    """``(X, Y, model, optimizer)``, the same in every process."""
    data = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=data)
    y = x @ torch.randn(6, 1, generator=data) + 0.1 * torch.randn(SAMPLES, 1, generator=data)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return x, y, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
