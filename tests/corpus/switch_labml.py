"""A Switch Transformer port, mirrored from labmlai/annotated_deep_learning_paper_implementations
(``labml_nn/transformers/switch/__init__.py``: ``SwitchFeedForward``).

Style: top-1 routing by ``torch.max(softmax(switch(x)), dim=-1)``; per expert
``torch.eq(routes, i).nonzero(as_tuple=True)[0]`` (token indices only); each expert's output written (not added)
into ``final_output[indexes, :]``; the whole output then scaled by the chosen probability (``is_scale_prob``).
Token dropping is off (``drop_tokens=False``), as in the port's default configuration; the experts are plain
``FeedForward`` (``Linear -> ReLU -> Linear`` with biases).
"""
import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, I, E = 16, 24, 4


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(H, I)
        self.layer2 = nn.Linear(I, H)
        self.activation = nn.ReLU()

    def forward(self, x):
        return self.layer2(self.activation(self.layer1(x)))


class SwitchFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_experts, self.is_scale_prob = E, True
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])
        self.switch = nn.Linear(H, E)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        seq_len, batch_size, d_model = x.shape
        x = x.view(-1, d_model)
        route_prob = self.softmax(self.switch(x))
        route_prob_max, routes = torch.max(route_prob, dim=-1)
        indexes_list = [torch.eq(routes, i).nonzero(as_tuple=True)[0] for i in range(self.n_experts)]
        final_output = x.new_zeros(x.shape)
        expert_output = [self.experts[i](x[indexes_list[i], :]) for i in range(self.n_experts)]
        for i in range(self.n_experts):
            final_output[indexes_list[i], :] = expert_output[i]
        if self.is_scale_prob:
            final_output = final_output * route_prob_max.view(-1, 1)
        else:
            final_output = final_output * (route_prob_max / route_prob_max.detach()).view(-1, 1)
        return final_output.view(seq_len, batch_size, d_model)


CASES = [Case("switch_labml", "labmlai/annotated_deep_learning_paper_implementations "
              "labml_nn/transformers/switch/__init__.py SwitchFeedForward", SwitchFeedForward,
              lambda T, g: torch.randn(T, 2, H, generator=g), form="unrolled_loop")]
