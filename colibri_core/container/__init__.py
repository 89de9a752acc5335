"""The on-disk container: a converted model directory (format version 1).

Files:

- ``config.json`` and, when the source has them, ``generation_config.json``, ``tokenizer.json``,
  ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``: copied as is.
- ``resident.safetensors``: the resident tensors (embeddings, attention, norms, routers, shared
  experts) under their checkpoint names. A tensor of manifest kind ``array`` (every non-2-D
  tensor, and the 2-D ones the layout keeps f32, e.g. routers) is one float32 tensor of its
  logical shape; a quantised matrix (kind f32/int8/int4 = ``--quant``) is stored as its
  `quant.layout` parts: ``NAME`` (data) and, for int8/int4, ``NAME.__scales``.
- ``experts/layer-LLL.bin``: one file per MoE layer; expert e's extent at ``e * expert_nbytes``.
  Inside an extent: gate ``[I, H]``, up ``[I, H]``, down ``[H, I]`` written by `quant.pack`
  (parts 64-byte aligned) from offset 0, zero padding, and a 16-byte trailer in the extent's
  last bytes: ``b"CLXE"``, u32 layer, u32 expert, u32 crc32 of every byte of the extent before
  the crc (all little-endian). ``expert_nbytes`` is a multiple of 4096, so one ``pread`` (also
  with ``O_DIRECT``) loads one expert, and the extent checks itself. A layer whose experts the
  plugin keeps more precise than ``--quant`` (`ContainerLayout.expert_min_kind`, e.g. GLM's MTP
  experts at int8 in an int4 container) says so in its file entry (``kind``, ``expert_nbytes``).
- ``colibri.yaml``: the manifest, written last (see `writer._manifest` for the keys): format and
  version, architecture, plugin and version, quantisation per tensor class and per resident
  tensor, the expert section (shapes, extent size, source form and name patterns), the file table
  with sizes and crc32 checksums (and one per expert extent), and a fingerprint of the source
  that binds its content (``source.content``: a digest of every source tensor's bytes). Its last
  line, ``# crc32 XXXXXXXX of the lines above``, checks the manifest itself (a manifest without
  it, written by an earlier colibri, is read unchecked).

A conversion in progress lives in ``DST.partial/`` (without ``colibri.yaml`` until the end) and
is renamed to DST when finished, so a directory with a manifest is always a whole container.
"""
from .dequant import dequantize
from .reader import FORMAT_VERSION, Container
from .writer import convert

__all__ = ["FORMAT_VERSION", "Container", "convert", "dequantize"]
