"""Linear-attention layers (gated delta rules, Mamba2 scans) over a verify block: token by token, every state kept.

transformers runs a GatedDeltaNet layer over more than one token by its chunked rule, which pads the block to a
64-token chunk and solves the chunk's triangular system one row at a time (63 dependent launches a layer on CUDA,
however short the block), and hands the cache the state after the whole block only: a row that keeps part of a
verify block would then need its kept tokens run through the layer again. Within `stepwise_linear_attention(model)`,
a call that starts from a state and covers at most STEPWISE_TOKENS tokens runs the family's recurrent rule one token
at a time instead -- the rule transformers' own decode runs for each token, bit for bit on the same inputs -- and
returns the state after each token, stacked [batch, tokens, heads, key dim, value dim]:
`TargetCache.commit_linear` keeps each row's state after its last kept token. Prompts (no state yet, or longer
chunks) keep the chunked rule, but for Jamba's scan, which cannot start from a state: it steps a longer chunk too.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from .families import spec_for_model

# the chunked rule's chunk: a shorter block pays for a whole chunk, a longer one is a prompt's
STEPWISE_TOKENS = 64


@functools.cache  # one function per rule pair: Dynamo guards compiled steps on the global's identity
def stepwise_rule(chunked, recurrent):
    """`chunked`'s signature and results, computed by `recurrent` one token at a time where a state is given and the
    block is at most STEPWISE_TOKENS long; the final state is then the state after each token."""

    @functools.wraps(chunked)
    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        tokens = query.shape[1]
        if initial_state is None or tokens > STEPWISE_TOKENS:
            return chunked(query, key, value, g=g, beta=beta, initial_state=initial_state,
                           output_final_state=output_final_state, **kwargs)
        outputs, states, state = [], [], initial_state
        for t in range(tokens):
            step = slice(t, t + 1)
            out, state = recurrent(query[:, step], key[:, step], value[:, step], g=g[:, step], beta=beta[:, step],
                                   initial_state=state, output_final_state=True, **kwargs)
            outputs.append(out)
            states.append(state)
        return torch.cat(outputs, dim=1), torch.stack(states, dim=1) if output_final_state else None

    rule.stepwise = True
    return rule


@functools.cache
def stepwise_mamba2_rule(chunked, recurrent):
    """Mamba2's chunked scan (`mamba2_chunk_scan`'s signature and results) computed, where a state is given and the
    block is at most STEPWISE_TOKENS long, by `recurrent` (`mamba2_selective_state_update`) one token at a time on
    the per-head parameters transformers' mixer expands for its decode; the final state is then the state after
    each token [batch, tokens, heads, head dim, state size]. The update writes its state in place: it gets a copy."""

    @functools.wraps(chunked)
    def rule(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        batch, tokens, heads, head_dim = hidden_states.shape
        if initial_states is None or tokens > STEPWISE_TOKENS:
            return chunked(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                           dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
                           **kwargs)
        per_head = dict(A=A[:, None, None].expand(-1, head_dim, B.shape[-1]),
                        D=None if D is None else D[:, None].expand(-1, head_dim),
                        dt_bias=None if dt_bias is None else dt_bias[:, None].expand(-1, head_dim))
        state, outputs, states = initial_states.clone(), [], []
        for t in range(tokens):
            outputs.append(recurrent(state, hidden_states[:, t], dt[:, t, :, None].expand(-1, -1, head_dim),
                                     B=B[:, t], C=C[:, t], dt_softplus=dt_softplus, **per_head, **kwargs))
            states.append(state.clone())
        output = torch.stack(outputs, dim=1)
        return (output, torch.stack(states, dim=1)) if return_final_states else output

    rule.stepwise = True
    return rule


@functools.cache
def stepwise_mamba1_scan(chunked, recurrent):
    """Jamba's scan of a mixer (`mamba_scan_forward`, which reads and writes the layer's state in the cache itself)
    computed, where the cache holds a state and the input has more than one token, by `recurrent`
    (`mamba_selective_state_update`, on the parameters as the scan reads them) one token at a time, as transformers'
    decode runs each token; the cache then gets the state after each token [batch, tokens, intermediate, state size]
    of a block of at most STEPWISE_TOKENS, or the last state of a longer prompt chunk. (transformers' own scan over
    several tokens starts from a zero state, whatever the cache holds.) The update writes its state in place: it
    gets a copy."""

    @functools.wraps(chunked)
    def scan(module, hidden_states, time_step, B, C, gate, cache, **kwargs):
        tokens = hidden_states.shape[-1]
        state = None if cache is None else cache.get_recurrent_state(module.layer_idx)
        if state is None or tokens == 1:
            return chunked(module, hidden_states, time_step, B, C, gate, cache, **kwargs)
        A = -torch.exp(module.A_log.float())
        dt_bias = module.dt_proj.bias.float() if module.dt_proj.bias is not None else None
        state, outputs, states = state.clone(), [], []
        for t in range(tokens):
            outputs.append(recurrent(state, hidden_states[..., t], time_step[..., t], A, B[:, t], C[:, t], module.D,
                                     z=gate[..., t], dt_bias=dt_bias, dt_softplus=True))
            if tokens <= STEPWISE_TOKENS:
                states.append(state.clone())
        cache.update_recurrent_state(torch.stack(states, dim=1) if states else state, module.layer_idx)
        return torch.stack(outputs, dim=-1)

    scan.stepwise = True
    return scan


class _OneState:
    """The cache one token's lightning forward sees: the state the token before it left, replaced by its own."""

    def __init__(self, state: torch.Tensor):
        self.state = state

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor:
        return self.state

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.state = state


@functools.cache
def stepwise_lightning(chunked, recurrent):
    """MiniMax's lightning attention forward (`chunked`), which over several tokens from a cached state runs its
    recurrence but hands the cache the last state only, run where the cache holds a state and the block has 2 to
    STEPWISE_TOKENS tokens by `recurrent` (the same forward: its one-token decode) a token at a time, each from the
    state the token before left; the cache then gets the state after each token [batch, tokens, heads, head dim, head
    dim]."""

    @functools.wraps(chunked)
    def forward(module, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        tokens = hidden_states.shape[1]
        state = None if cache is None else cache.get_linear_cache(module.layer_idx)
        if state is None or tokens == 1 or tokens > STEPWISE_TOKENS:
            return chunked(module, hidden_states=hidden_states, position_embeddings=position_embeddings,
                           attention_mask=attention_mask, cache=cache, **kwargs)
        step, outputs, states = _OneState(state), [], []
        for t in range(tokens):
            mask = None if attention_mask is None else attention_mask[:, t:t + 1]
            out, _ = recurrent(module, hidden_states=hidden_states[:, t:t + 1], position_embeddings=position_embeddings,
                               attention_mask=mask, cache=step, **kwargs)
            outputs.append(out)
            states.append(step.state)
        cache.set_linear_cache(module.layer_idx, torch.stack(states, dim=1))
        return torch.cat(outputs, dim=1), None

    forward.stepwise = True
    return forward


@functools.cache
def stepwise_delayed_value(chunked, recurrent):
    """ZAYA1's CCA projection forward (`chunked`), which hands the cache its block's last delayed value projection as
    the state: where the cache holds a state, the cache gets each token's instead [batch, tokens, width] (the state
    after each token: its own projection, nothing recurrent), computed again from the block's masked input. Its
    convolution's window is the cache's conv window, committed as any."""

    @functools.wraps(chunked)
    def forward(module, hidden_states, cache, conv_mask=None):
        stepped = cache is not None and cache.get_recurrent_state(module.layer_idx) is not None
        out = chunked(module, hidden_states, cache, conv_mask)
        if stepped:
            masked = hidden_states if conv_mask is None else hidden_states * conv_mask[:, :, None].to(
                hidden_states.dtype)
            cache.update_recurrent_state(module.v_proj_delayed(masked), module.layer_idx)
        return out

    forward.stepwise = True
    return forward


# a verify block's stepped rule by `LinearAttentionSpec.rule`
STEPWISE_RULES = {"delta": stepwise_rule, "mamba2": stepwise_mamba2_rule, "mamba1": stepwise_mamba1_scan,
                  "lightning": stepwise_lightning, "delayed_value": stepwise_delayed_value}


def check_verify_block(model, block_size: int) -> None:
    """A drafter's block must fit `stepwise_rule`: a longer verify block would leave one state for all its tokens."""
    spec = spec_for_model(model)
    kinds = spec.attention_kinds(model.config.get_text_config()) if spec else []
    if "linear_attention" in kinds and block_size > STEPWISE_TOKENS:
        raise ValueError(f"the drafter's block of {block_size} tokens is longer than {type(model).__name__}'s "
                         f"linear-attention layers verify token by token ({STEPWISE_TOKENS}): use a drafter with a "
                         "shorter block")


@contextlib.contextmanager
def stepwise_linear_attention(model):
    """Within: `model`'s linear-attention layers run verify blocks by `stepwise_rule`; their modules' own rules are
    back afterwards."""
    spec = spec_for_model(model)
    linear = spec.linear_attention if spec else None
    if linear is None:
        yield
        return
    mixers = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == linear.mixer]
    # the rules' names in the mixers' modeling module: functions, or a class's method ("Class.forward")
    owner, _, chunked_name = linear.chunked.rpartition(".")
    namespaces = {functools.reduce(getattr, filter(None, owner.split(".")), sys.modules[type(mixer).__module__])
                  for mixer in mixers}
    originals = [(ns, getattr(ns, chunked_name)) for ns in namespaces]
    recurrent_name = linear.recurrent.rpartition(".")[2]
    try:
        for ns, chunked in originals:
            if not getattr(chunked, "stepwise", False):  # ours already inside a nested call
                setattr(ns, chunked_name, STEPWISE_RULES[linear.rule](chunked, getattr(ns, recurrent_name)))
        yield
    finally:
        for ns, chunked in originals:
            setattr(ns, chunked_name, chunked)
