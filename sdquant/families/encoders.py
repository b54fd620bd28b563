"""The networks around the backbone that families share: CLIP and T5 text encoders and the VAE
decoder, each as the module its graph is traced from and run as (input names in, graph outputs
out)."""

from __future__ import annotations

import torch

from ..graphs.networks import BATCH, TEXT_TOKENS, Network


def clip_network(name: str, hidden: bool = True, pooled: bool = False) -> Network:
    """input_ids (one CLIP window) -> the hidden states the pipeline conditions on, its pooled
    embedding, or both."""
    outputs = {**({"hidden_states": {0: BATCH}} if hidden else {}), **({"pooled": {0: BATCH}} if pooled else {})}
    return Network(name, {"input_ids": {0: BATCH}}, outputs)


def t5_network(name: str = "t5") -> Network:
    """input_ids (the T5 sequence, dynamic) -> its last hidden states."""
    return Network(name, {"input_ids": {0: BATCH, 1: TEXT_TOKENS}}, {"hidden_states": {0: BATCH, 1: TEXT_TOKENS}})


def _eager_attention(encoder) -> None:
    # The exporter's SDPA symbolic adds an fp32 causal mask, which turns an fp16 graph into a mix of
    # types ONNX Runtime and strongly typed TensorRT refuse; eager attention writes the mask and
    # softmax out in the model's own types.
    encoder.set_attn_implementation("eager")


class ClipGraph(torch.nn.Module):
    """input_ids -> CLIP's hidden states (the penultimate layer's for SDXL and SD3, the last for SD)
    and/or its pooled embedding (the projection's where the encoder has one)."""

    def __init__(self, encoder, penultimate: bool, hidden: bool = True, pooled: bool = False):
        super().__init__()
        _eager_attention(encoder)
        self.encoder = encoder
        self.penultimate = penultimate
        self.hidden = hidden
        self.pooled = pooled

    def forward(self, input_ids):
        out = self.encoder(input_ids, output_hidden_states=self.hidden)
        outputs = []
        if self.hidden:
            outputs.append(out.hidden_states[-2] if self.penultimate else out.last_hidden_state)
        if self.pooled:
            outputs.append(out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output)
        return tuple(outputs) if len(outputs) > 1 else outputs[0]


class T5Graph(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids):
        return self.encoder(input_ids).last_hidden_state


class VaeDecoderGraph(torch.nn.Module):
    """latent -> image in [-1, 1], with the pipeline's latent scaling (and a shift, for VAEs that
    have one) inside the graph."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent):
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        return self.vae.decode(latent / self.vae.config.scaling_factor + shift, return_dict=False)[0]
