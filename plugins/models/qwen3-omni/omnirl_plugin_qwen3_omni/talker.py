"""The Qwen3-Omni talker (transformers ``Qwen3OmniMoeTalkerForConditionalGeneration`` with its code predictor) as a
token policy over codec frames, and code2wav (``Qwen3OmniMoeCode2Wav``) turning each sample's frames into speech.

One step of the talker is one frame of ``K`` codes: the talker's MoE decoder gives the first codebook's code (its
``codec_head``), then the code predictor, a small decoder fed [talker hidden state, first code], draws the ``K - 1``
residual codes one after the other. A frame's log-prob is the sum of its ``K`` codes' log-probs, each under the
core's sampling distribution (``omnirl_core.ar.sampling.sampling_logprobs``), so that GSPO / GRPO see one value per
frame (sequence = frames); the codebooks' fp32 log-probs are summed in float64 (exact, whatever the order) and
the frame's sum stored in fp32. The next talker input is the sum of the frame's ``K`` code embeddings plus the projected
embedding of the next text token to speak (``trailing`` text), as transformers' ``Qwen3OmniMoeForConditionalGeneration
.generate`` feeds it.

Rollout samples frame by frame with a KV cache (``sample``); the trainer re-scores the same frames teacher-forced in
one talker pass and one code predictor pass (``token_logprobs_under``). Both call the same modules on the same inputs
and the same ``sampling_logprobs``.

A completion is a (T, K) long tensor of codes, one row per frame. When the talker stopped, its last row is the
end-of-speech frame: ``[codec_eos, -1, ..., -1]`` (the code predictor is not run for it; -1 marks "no code"), and
its log-prob is the first codebook's alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from omnirl_core.ar.model import CausalLMPolicy
from omnirl_core.ar.sampling import SamplingParams, TokenPrompt, sample_tokens, sampling_logprobs
from omnirl_core.contracts import GenRequest, Sample, Speech
from omnirl_core.errors import UsageError

SAMPLE_RATE = 24_000
"""code2wav's output rate (the released vocoder's 24 kHz)."""
NO_CODE = -1
"""The residual codes of the end-of-speech frame, which the code predictor never draws."""


class Qwen3OmniTalker(CausalLMPolicy):
    """The talker of a whole Qwen3-Omni model (``self.module``: ``Qwen3OmniMoeForConditionalGeneration`` with
    ``enable_audio_output``) as a token policy; the thinker and code2wav stay frozen. ``module`` is the whole model,
    so LoRA and full checkpoints carry its names (``talker.model.layers.0.self_attn.q_proj``) and load back into
    ``Qwen3OmniMoeForConditionalGeneration``."""

    capabilities = frozenset({"ar-text", "lora", "speech", "audio"})  # text prompts in, speech out
    # the talker's and the code predictor's attention (the talker's experts are fused 3-D parameters)
    default_lora_targets = (r"talker\.(model|code_predictor\.model)\.layers\.\d+\.self_attn\."
                            r"(q_proj|k_proj|v_proj|o_proj)")
    samples_itself = True

    source: str = ""  # the checkpoint directory or hub id (create_model sets it)

    def __init__(self, module: Any, tokenizer: Any, speaker: str, device: torch.device, dtype: torch.dtype):
        super().__init__(module, tokenizer, device, dtype)
        self.talker = module.talker
        self.code2wav = module.code2wav
        self.thinker = module.thinker
        config = module.config
        talker_config = config.talker_config
        speakers = {k.lower(): int(v) for k, v in (talker_config.speaker_id or {}).items()}
        if speaker.lower() not in speakers:
            raise UsageError(f"The checkpoint's talker has no speaker '{speaker}'.",
                             hint=f"Set model.options.speaker to one of: {', '.join(sorted(speakers)) or 'none'}.")
        self.speaker_id = speakers[speaker.lower()]
        self.groups = int(talker_config.num_code_groups)
        self.codebook = int(module.code2wav.config.codebook_size)
        self.codec_eos = int(talker_config.codec_eos_token_id)
        # the codec ids the talker's prefix holds after the text: no-think, think begin / end, the voice, pad, begin
        self.codec_prefix = [int(talker_config.codec_nothink_id), int(talker_config.codec_think_bos_id),
                             int(talker_config.codec_think_eos_id), self.speaker_id, int(talker_config.codec_pad_id),
                             int(talker_config.codec_bos_id)]
        self.tts_ids = [int(config.tts_bos_token_id), int(config.tts_eos_token_id), int(config.tts_pad_token_id)]
        self.im_end_id = int(config.im_end_token_id)

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.thinker, self.code2wav]

    def called_submodules(self) -> list[torch.nn.Module]:
        return [self.talker.model, self.talker.codec_head, self.talker.code_predictor, self.talker.text_projection]

    # -- tokens --------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.codec_eos,)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def token_id(self, text: str) -> int:
        raise ValueError(f"the talker samples codec codes, not text tokens ({text!r}): allowed_tokens and "
                         "stop_tokens do not apply to model.options.train=talker; set them to null (--set "
                         "rollout.options.allowed_tokens=null), or use --preset tiny-talker for the tiny model")

    def decode(self, ids: torch.Tensor) -> str:
        frames = int((ids[:, 0] != self.codec_eos).sum()) if ids.dim() == 2 else 0
        return f"<{frames} codec frames>"

    # -- prompts -------------------------------------------------------------------------------
    def encode_prompt(self, request: GenRequest) -> TokenPrompt:
        """Text to speech: the prompt is the text spoken. The thinker's token ids of a chat where the user gives the
        text and the assistant says it: [user turn] + ``<|im_start|>assistant\\n`` + text + ``<|im_end|>``;
        ``media['user_tokens']`` holds the user turn's length (the talker reads the two parts differently)."""
        if request.inputs.get("image") is not None or request.inputs.get("audio") is not None \
                or request.inputs.get("video") is not None:
            raise UsageError("The talker speaks text prompts; this record has media.",
                             hint="Give text-only prompts to model.options.train=talker.")
        text = request.prompt.strip()
        if not text:
            raise UsageError("An empty prompt: the talker has nothing to say.", hint="Give the text to speak.")
        messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        chat = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        user = self.tokenizer(chat, add_special_tokens=False)["input_ids"]
        header = self.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        spoken = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = user + header + spoken + [self.im_end_id]
        return TokenPrompt(torch.tensor(ids, dtype=torch.long), {"user_tokens": torch.tensor(len(user))})

    def media_inputs(self, media: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {}

    def _conditioning(self, prompt: TokenPrompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prefix (P, H), trailing text (N, H), text pad (H,)) of one prompt, as transformers' omni ``generate``
        builds them from the thinker's token embeddings: the user turn through ``text_projection``; then 9 assistant
        positions, each the sum of a text part ([im_start, assistant, newline], 4 x tts_pad, tts_bos, first text token)
        and a codec part (3 x zero, no-think, think begin, think end, speaker, codec pad, codec begin). The remaining
        text tokens, then tts_eos, are added to the talker's input one per frame (``trailing``), tts_pad after."""
        ids = prompt.input_ids.to(self.device)
        user = int(prompt.media["user_tokens"])
        embed = self.thinker.get_input_embeddings()
        projected = self.talker.text_projection(embed(torch.cat([ids, torch.tensor(self.tts_ids, device=self.device)])))
        text, (tts_bos, tts_eos, tts_pad) = projected[:-3], projected[-3:]
        assistant = text[user:]
        text_part = torch.cat([assistant[:3], tts_pad.expand(4, -1), tts_bos[None], assistant[3:4]])
        codec = self.talker.get_input_embeddings()(torch.tensor(self.codec_prefix, device=self.device))
        codec_part = torch.cat([codec.new_zeros(3, codec.shape[-1]), codec])
        prefix = torch.cat([text[:user], text_part + codec_part])
        trailing = torch.cat([assistant[4:], tts_eos[None]])
        return prefix, trailing, tts_pad

    # -- frames --------------------------------------------------------------------------------
    def _distributions(self, params: SamplingParams) -> tuple[SamplingParams, SamplingParams]:
        """The first codebook's distribution (codes and the end of speech only, as the released generate suppresses
        the talker's other special ids) and the residual codebooks' (the code predictor's whole vocabulary)."""
        allowed = (*range(self.codebook), self.codec_eos)
        first = replace(params, allowed_token_ids=allowed, stop_token_ids=(self.codec_eos,))
        return first, replace(params, allowed_token_ids=None, stop_token_ids=())

    def _frame_embeddings(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the K code embeddings of frames (N, K) -> (N, H): the first codebook through the talker's codec
        embedding, code j >= 1 through the code predictor's embedding j - 1."""
        total = self.talker.get_input_embeddings()(codes[:, 0])
        residual = self.talker.code_predictor.get_input_embeddings()
        for j in range(1, self.groups):
            total = total + residual[j - 1](codes[:, j])
        return total

    def _frame_inputs(self, codes: torch.Tensor, trailing: torch.Tensor, pad: torch.Tensor, start: int) -> torch.Tensor:
        """The talker inputs after frames (N, K) numbered from ``start``: their code embeddings plus the text to
        speak at that step (then text pad)."""
        n = len(codes)
        text = trailing[start:start + n]
        if len(text) < n:
            text = torch.cat([text, pad.expand(n - len(text), -1)])
        return self._frame_embeddings(codes) + text

    def _talker_hidden(self, embeds: torch.Tensor, mask: torch.Tensor, cache: Any = None,
                       positions: torch.Tensor | None = None) -> Any:
        if positions is None:
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
        return self.talker.model(inputs_embeds=embeds, attention_mask=mask, cache=cache, use_cache=cache is not None,
                                 position_ids=positions[None].expand(3, -1, -1))

    @torch.no_grad()
    def sample(self, requests: Sequence[GenRequest], prompts: Sequence[TokenPrompt], params: SamplingParams,
               generators: Sequence[torch.Generator]) -> list[Sample]:
        """Frames for a batch of requests, each row drawn with its own generator (code 0, then codes 1..K-1 of every
        frame, in that order), up to ``params.max_new_tokens`` frames or the end of speech."""
        from transformers import DynamicCache

        first, residual = self._distributions(params)
        conds = [self._conditioning(p) for p in prompts]
        length = max(len(c[0]) for c in conds)
        hidden_size = conds[0][0].shape[-1]
        embeds = conds[0][0].new_zeros(len(conds), length, hidden_size)
        mask = torch.zeros(len(conds), length, dtype=torch.long, device=self.device)
        for b, (prefix, _, _) in enumerate(conds):  # left padding: every row's next position is the last
            embeds[b, length - len(prefix):] = prefix
            mask[b, length - len(prefix):] = 1
        cache = DynamicCache(config=self.talker.config.text_config)
        h = self._talker_hidden(embeds, mask, cache).last_hidden_state[:, -1]
        positions = mask.sum(-1, keepdim=True) - 1
        frames, logprobs = [], []
        done = torch.zeros(len(conds), dtype=torch.bool)
        for t in range(params.max_new_tokens):
            codes, logp = self._draw_frame(h, first, residual, generators)
            frames.append(codes.cpu())
            logprobs.append(logp.cpu())
            done |= codes[:, 0].cpu() == self.codec_eos
            if bool(done.all()) or t + 1 == params.max_new_tokens:
                break
            step = torch.stack([self._frame_inputs(codes[b:b + 1], c[1], c[2], t)[0] for b, c in enumerate(conds)])
            mask = torch.cat([mask, mask.new_ones(len(conds), 1)], dim=1)
            positions = positions + 1
            h = self._talker_hidden(step[:, None], mask, cache, positions).last_hidden_state[:, -1]
        codes_bt = torch.stack(frames, dim=1)  # (B, T, K)
        logp_bt = torch.stack(logprobs, dim=1)
        samples = []
        for b, (request, prompt) in enumerate(zip(requests, prompts)):
            stops = (codes_bt[b, :, 0] == self.codec_eos).nonzero()
            n = int(stops[0]) + 1 if len(stops) else codes_bt.shape[1]
            completion = codes_bt[b, :n].clone()
            if len(stops):
                completion[-1, 1:] = NO_CODE
            samples.append(Sample(
                request=request, latents=None, sigmas=None, logprobs=logp_bt[b, :n].float(),
                output=self.speech(completion, request.prompt), prompt_tokens=prompt, completion=completion,
                sampling=params, extras={"truncated": not len(stops)},
            ))
        return samples

    def _draw_frame(self, h: torch.Tensor, first: SamplingParams, residual: SamplingParams,
                    generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame per row from the talker's last hidden states (B, H): codes (B, K) and the frame log-probs (B,)
        (an end-of-speech frame: its first code's alone)."""
        from transformers import DynamicCache

        predictor = self.talker.code_predictor
        logp0 = sampling_logprobs(self.talker.codec_head(h), first)
        code = sample_tokens(logp0, generators)
        total = logp0.gather(-1, code[:, None])[:, 0].double()  # float64: the sum is exact, in any order
        codes = [code]
        cache = DynamicCache(config=predictor.config)
        x = torch.stack([h, self.talker.get_input_embeddings()(code)], dim=1)
        for j in range(1, self.groups):
            out = predictor.model(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state[:, -1]
            logp = sampling_logprobs(predictor.lm_head[j - 1](out), residual)
            code = sample_tokens(logp, generators)
            total = total + logp.gather(-1, code[:, None])[:, 0].double() * (codes[0] != self.codec_eos)
            codes.append(code)
            x = predictor.get_input_embeddings()[j - 1](code)[:, None]
        return torch.stack(codes, dim=1), total

    # -- scoring -------------------------------------------------------------------------------
    def token_logprobs_under(self, prompts: Sequence[TokenPrompt], completions: Sequence[torch.Tensor],
                             distributions: Sequence[Sequence[SamplingParams]]) -> list[list[torch.Tensor]]:
        """Per-frame log-probs (sum over the frame's codebooks) of the given frames, teacher-forced: one talker pass
        over [prefix, inputs after frames 0..T-2] per row (right-padded), one code predictor pass over every frame
        but the end-of-speech one."""
        conds = [self._conditioning(p) for p in prompts]
        frames = [c.to(self.device) for c in completions]
        seqs = [torch.cat([prefix, self._frame_inputs(f[:-1], trailing, pad, 0)]) if len(f) > 1 else prefix
                for (prefix, trailing, pad), f in zip(conds, frames)]
        length = max(len(s) for s in seqs)
        embeds = seqs[0].new_zeros(len(seqs), length, seqs[0].shape[-1])
        mask = torch.zeros(len(seqs), length, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            embeds[i, :len(s)] = s
            mask[i, :len(s)] = 1
        hidden = self._talker_hidden(embeds, mask).last_hidden_state
        # the state before frame t is at position P - 1 + t
        h = torch.cat([hidden[i, len(c[0]) - 1:len(c[0]) - 1 + len(f)] for i, (c, f) in enumerate(zip(conds, frames))])
        codes = torch.cat(frames)
        spoken = codes[:, 0] != self.codec_eos
        predictor = self.talker.code_predictor
        embeddings = predictor.get_input_embeddings()
        sel = spoken.nonzero()[:, 0]
        if len(sel):
            x = torch.stack([h[sel], self.talker.get_input_embeddings()(codes[sel, 0]),
                             *[embeddings[j - 1](codes[sel, j]) for j in range(1, self.groups - 1)]], dim=1)
            out = predictor.model(inputs_embeds=x, use_cache=False).last_hidden_state  # (M, K, H)
        else:  # every row stopped at its first frame: no residual codes to score (the predictor takes no empty batch)
            out = h.new_zeros(0, self.groups, predictor.lm_head[0].in_features)
        logits0 = self.talker.codec_head(h)
        residual_logits = [predictor.lm_head[j - 1](out[:, j]) for j in range(1, self.groups)]
        row_of = torch.cat([torch.full((len(f),), i) for i, f in enumerate(frames)])
        results = []
        for params in distributions:
            total = torch.zeros(len(codes), dtype=torch.float64, device=logits0.device)
            for sp in dict.fromkeys(params):  # one pass per distinct sampling distribution (usually one)
                rows = torch.tensor([j for j, q in enumerate(params) if q == sp])
                first, residual = self._distributions(sp)
                idx = torch.isin(row_of, rows).nonzero()[:, 0].to(self.device)
                lp0 = sampling_logprobs(logits0.index_select(0, idx), first).gather(-1, codes[idx, :1])[:, 0]
                total = total.index_put((idx,), lp0.double())
                ridx = torch.isin(row_of[sel.cpu()], rows).nonzero()[:, 0].to(self.device)
                extra = torch.zeros(len(ridx), dtype=torch.float64, device=logits0.device)
                for j, logits in enumerate(residual_logits, start=1):
                    lp = sampling_logprobs(logits.index_select(0, ridx), residual)
                    extra = extra + lp.gather(-1, codes[sel[ridx], j:j + 1])[:, 0].double()
                total = total.index_put((sel[ridx],), extra, accumulate=True)
            results.append(list(total.float().split([len(f) for f in frames])))
        return results

    def token_logprobs(self, prompts: Sequence[TokenPrompt], completions: Sequence[torch.Tensor],
                       params: Sequence[SamplingParams]) -> list[torch.Tensor]:
        return self.token_logprobs_under(prompts, completions, [params])[0]

    # -- speech --------------------------------------------------------------------------------
    @torch.no_grad()
    def speech(self, completion: torch.Tensor, text: str) -> Speech:
        """code2wav over a completion's spoken frames (not the end-of-speech one), once: 24 kHz, mono, on the CPU."""
        codes = completion[completion[:, 0] != self.codec_eos]
        if not len(codes):
            return Speech(torch.zeros(0), SAMPLE_RATE, text)
        wave = self.code2wav.chunked_decode(codes.T[None].to(self.device))
        return Speech(wave.reshape(-1).float().cpu(), SAMPLE_RATE, text)
