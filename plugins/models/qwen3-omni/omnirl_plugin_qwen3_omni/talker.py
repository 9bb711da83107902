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

What the talker speaks (``speak``): the prompt itself (text to speech), or the reply the thinker generates to the prompt
in the same rollout (``reply``), as the released model answers aloud: the thinker samples its reply token by token
(``omnirl_core.ar.sampling``, with the rollout's distribution; ``rollout.options.allowed_tokens`` / ``stop_tokens`` then
name the thinker's tokens), and the talker is conditioned on it exactly as on a given text (transformers' ``generate``
conditions it on the thinker's token embeddings at text positions; its hidden states only at media positions, which the
talker refuses). With the thinker frozen the sequence is the frames alone and a sample's ``prompt_tokens`` is the talker's
prompt with the reply in it. Trained jointly (``joint``), the sequence is the reply's tokens followed by the frames: a
completion row is ``[part, ...]`` (part 0: ``[0, token, -1, ..., -1]``; part 1: ``[1, code 0, ..., code K-1]``), one
log-prob per row, the sample's log-prob the sum of both modules' (``logprob_parts``: the per-module split).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from omnirl_core.ar.model import CausalLMPolicy
from omnirl_core.ar.sampling import (
    SamplingParams,
    TokenPrompt,
    pad_sequences,
    sample_tokens,
    sampling_logprobs,
)
from omnirl_core.contracts import GenRequest, Sample, Speech
from omnirl_core.errors import UsageError

SAMPLE_RATE = 24_000
"""code2wav's output rate (the released vocoder's 24 kHz)."""
NO_CODE = -1
"""The residual codes of the end-of-speech frame, which the code predictor never draws."""
THINKER_PART, TALKER_PART = 0, 1
"""Joint training: the first column of a completion row says which module drew it (``Qwen3OmniTalker.logprob_parts``)."""
THINKER_LORA_TARGETS = r"thinker\.model\.language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
"""Joint training: the thinker's text decoder attention, beside the talker's (``default_lora_targets``)."""


class Qwen3OmniTalker(CausalLMPolicy):
    """The talker of a whole Qwen3-Omni model (``self.module``: ``Qwen3OmniMoeForConditionalGeneration`` with
    ``enable_audio_output``) as a token policy; code2wav stays frozen, the thinker too unless ``joint``. ``module`` is
    the whole model, so LoRA and full checkpoints carry its names (``talker.model.layers.0.self_attn.q_proj``) and load
    back into ``Qwen3OmniMoeForConditionalGeneration``.

    ``speak``: ``prompt`` (the prompt is the text spoken) or ``reply`` (the thinker generates a reply to the prompt,
    at most ``reply_max_tokens`` tokens, and the talker speaks it). ``joint`` (with ``reply``): the thinker is trained
    too, its reply tokens and the talker's frames one sequence."""

    capabilities = frozenset({"ar-text", "lora", "speech", "audio"})  # text prompts in, speech out
    # the talker's and the code predictor's attention (the talker's experts are fused 3-D parameters)
    default_lora_targets = (r"talker\.(model|code_predictor\.model)\.layers\.\d+\.self_attn\."
                            r"(q_proj|k_proj|v_proj|o_proj)")
    samples_itself = True

    source: str = ""  # the checkpoint directory or hub id (create_model sets it)

    def __init__(self, module: Any, tokenizer: Any, speaker: str, device: torch.device, dtype: torch.dtype,
                 speak: str = "prompt", joint: bool = False, reply_max_tokens: int = 32, reply_min_tokens: int = 1,
                 system_prompt: str | None = None):
        super().__init__(module, tokenizer, device, dtype)
        if speak not in ("prompt", "reply"):
            raise ValueError(f"speak is 'prompt' or 'reply', not {speak!r}")
        if joint and speak != "reply":
            raise UsageError("Training the thinker with the talker needs the thinker to generate what is spoken.",
                             hint="Set model.options.speak=reply (or leave it unset) with "
                             "model.options.train=thinker+talker.")
        self.speak, self.joint = speak, joint
        self.reply_max_tokens, self.reply_min_tokens = reply_max_tokens, reply_min_tokens
        self.system_prompt = system_prompt
        if joint:
            self.logprob_parts = ("thinker", "talker")
            self.default_lora_targets = f"{THINKER_LORA_TARGETS}|{self.default_lora_targets}"
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
        if self.joint:  # the thinker's text decoder trains; its media encoders never do
            return [self.code2wav, self.thinker.model.audio_tower, self.thinker.model.visual]
        return [self.thinker, self.code2wav]

    def called_submodules(self) -> list[torch.nn.Module]:
        talker = [self.talker.model, self.talker.codec_head, self.talker.code_predictor, self.talker.text_projection]
        return [self.thinker.model.language_model, self.thinker.lm_head, *talker] if self.joint else talker

    def logprob_part_of(self, completion: torch.Tensor) -> torch.Tensor:
        """Joint: each row's first column (0 the thinker's reply token, 1 the talker's frame)."""
        if not self.joint:
            raise NotImplementedError("the talker alone has one log-prob part")
        return completion[:, 0].long()

    # -- tokens --------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """What ends the sampled text: the thinker's reply (end of turn, end of text) when it generates one; else the
        end of speech (the talker's frames stop on it whatever the rollout options, see ``_distributions``)."""
        if self.speak == "reply":
            ids = self.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
            return tuple(dict.fromkeys(int(i) for i in ids if i is not None and i != self.tokenizer.unk_token_id))
        return (self.codec_eos,)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def token_id(self, text: str) -> int:
        if self.speak == "reply":  # allowed_tokens / stop_tokens guide the thinker's reply
            return super().token_id(text)
        raise ValueError(f"the talker samples codec codes, not text tokens ({text!r}): allowed_tokens and "
                         "stop_tokens do not apply to model.options.train=talker with speak=prompt; set them to null "
                         "(--set rollout.options.allowed_tokens=null), or use --preset tiny-talker for the tiny model")

    def _split(self, completion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint: (the reply's token ids (n,), the frames (T, K)) of a completion."""
        part = completion[:, 0]
        return completion[part == THINKER_PART, 1], completion[part == TALKER_PART, 1:]

    def decode(self, ids: torch.Tensor) -> str:
        if ids.dim() != 2:
            return "<0 codec frames>"
        reply = ""
        if self.joint:
            tokens, ids = self._split(ids)
            reply = self.tokenizer.decode(tokens.tolist(), skip_special_tokens=True) + " "
        frames = int((ids[:, 0] != self.codec_eos).sum())
        return f"{reply}<{frames} codec frames>"

    # -- prompts -------------------------------------------------------------------------------
    def encode_prompt(self, request: GenRequest) -> TokenPrompt:
        """The thinker's token ids of a chat where the user gives the prompt, then ``<|im_start|>assistant\\n``; when the
        prompt is the text spoken (``speak=prompt``), the assistant says it: + text + ``<|im_end|>``. With
        ``speak=reply`` the thinker generates what follows (a system prompt, if set, goes first; the talker does not
        read it, as transformers' omni ``generate``). ``media['user_span']`` holds where the user turn is (the talker
        reads the user turn and the assistant's part differently)."""
        if request.inputs.get("image") is not None or request.inputs.get("audio") is not None \
                or request.inputs.get("video") is not None:
            raise UsageError("The talker speaks text prompts; this record has media.",
                             hint="Give text-only prompts to model.options.train=talker.")
        text = request.prompt.strip()
        if not text:
            raise UsageError("An empty prompt: the talker has nothing to say.", hint="Give the text to speak.")
        system: list[int] = []
        if self.speak == "reply" and self.system_prompt:
            turn = [{"role": "system", "content": [{"type": "text", "text": self.system_prompt}]}]
            system = self._chat_ids(turn)
        messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        user = self._chat_ids(messages)
        header = self.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        ids = system + user + header
        if self.speak == "prompt":
            ids += self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.im_end_id]
        span = torch.tensor([len(system), len(system) + len(user)])
        return TokenPrompt(torch.tensor(ids, dtype=torch.long), {"user_span": span})

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        chat = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return list(self.tokenizer(chat, add_special_tokens=False)["input_ids"])

    def media_inputs(self, media: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {}

    @staticmethod
    def spoken_prompt(prompt: TokenPrompt, reply: torch.Tensor) -> TokenPrompt:
        """The talker's prompt for a reply of the thinker: the thinker's prompt followed by the reply's tokens (its end
        of turn included when it stopped), the layout a prompt that is spoken itself has."""
        return TokenPrompt(torch.cat([prompt.input_ids, reply.to(prompt.input_ids)]), prompt.media)

    def _conditioning(self, prompt: TokenPrompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prefix (P, H), trailing text (N, H), text pad (H,)) of one talker prompt (the user turn, then the
        assistant's: ``<|im_start|>assistant\\n`` and the text spoken), as transformers' omni ``generate`` builds them
        from the thinker's token embeddings: the user turn through ``text_projection``; then 9 assistant positions,
        each the sum of a text part ([im_start, assistant, newline], 4 x tts_pad, tts_bos, first text token) and a
        codec part (3 x zero, no-think, think begin, think end, speaker, codec pad, codec begin). The remaining text
        tokens, then tts_eos, are added to the talker's input one per frame (``trailing``), tts_pad after."""
        ids = prompt.input_ids.to(self.device)
        start, end = (int(i) for i in prompt.media["user_span"])
        embed = self.thinker.get_input_embeddings()
        ids = torch.cat([ids[start:], torch.tensor(self.tts_ids, device=self.device)])
        projected = self.talker.text_projection(embed(ids))
        text, (tts_bos, tts_eos, tts_pad) = projected[:-3], projected[-3:]
        user = end - start
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
        """Frames for a batch of requests, each row drawn with its own generator (with ``speak=reply``, the thinker's
        reply tokens first; then code 0, codes 1..K-1 of every frame, in that order), up to ``params.max_new_tokens``
        frames or the end of speech."""
        if self.speak == "reply":
            replies, reply_logprobs = self._reply(prompts, params, generators)
            spoken = [self.spoken_prompt(p, r) for p, r in zip(prompts, replies)]
            texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True).strip() for r in replies]
        else:
            spoken, texts = list(prompts), [r.prompt for r in requests]
        frames, frame_logprobs, truncated = self._frames(spoken, params, generators)
        samples = []
        for b, request in enumerate(requests):
            completion, logprobs, prompt = frames[b], frame_logprobs[b], spoken[b]
            extras: dict[str, Any] = {"truncated": truncated[b]}
            if self.speak == "reply":
                extras["reply"] = texts[b]
            if self.joint:  # one sequence: the reply's tokens, then the frames; the prompt is the thinker's
                reply = replies[b]
                rows = torch.full((len(reply), 1 + self.groups), NO_CODE, dtype=torch.long)
                rows[:, 0], rows[:, 1] = THINKER_PART, reply
                framed = torch.cat([torch.full((len(completion), 1), TALKER_PART, dtype=torch.long), completion], 1)
                completion = torch.cat([rows, framed])
                logprobs = torch.cat([reply_logprobs[b], logprobs])
                prompt = prompts[b]
            samples.append(Sample(
                request=request, latents=None, sigmas=None, logprobs=logprobs.float(),
                output=self.speech(frames[b], texts[b]), prompt_tokens=prompt, completion=completion,
                sampling=params, extras=extras,
            ))
        return samples

    def _reply_distribution(self, params: SamplingParams) -> SamplingParams:
        """The thinker's: the rollout's (its allowed and stop tokens are the thinker's), at most ``reply_max_tokens``."""
        return replace(params, max_new_tokens=self.reply_max_tokens)

    def _reply_logits(self, logits: torch.Tensor, index: torch.Tensor, dist: SamplingParams) -> torch.Tensor:
        """The thinker's logits (N, V) for reply tokens number ``index`` (N,): the stop tokens masked out for the first
        ``reply_min_tokens`` (as transformers' ``min_new_tokens``: a reply is never empty), in rollout and trainer."""
        early = index.to(logits.device) < self.reply_min_tokens
        if not dist.stop_token_ids or not bool(early.any()):
            return logits
        stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        stop[list(dist.stop_token_ids)] = True
        return logits.masked_fill(early[:, None] & stop, float("-inf"))

    def _thinker_hidden(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any = None,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
        """The thinker's text decoder over token ids (text only: its position ids are the same on the three rotary
        axes, counted over each row's real tokens)."""
        if positions is None:
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
        return self.thinker.model.language_model(
            input_ids=ids, attention_mask=mask, cache=cache, use_cache=cache is not None,
            position_ids=positions[None].expand(3, -1, -1)).last_hidden_state

    def _reply(self, prompts: Sequence[TokenPrompt], params: SamplingParams,
               generators: Sequence[torch.Generator]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The thinker's reply to each prompt (token ids up to and with its stop token, on the CPU) and the tokens'
        log-probs (fp32), sampled with a KV cache; a row draws from its generator only until it stops, so that its
        frames, drawn next from the same generator, do not depend on its batch-mates' replies."""
        from transformers import DynamicCache

        dist = self._reply_distribution(params)
        ids, mask = pad_sequences([p.input_ids for p in prompts], self.pad_token_id, "left")
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.thinker.model.language_model.config)
        h = self._thinker_hidden(ids, mask, cache)[:, -1]
        positions = mask.sum(-1, keepdim=True) - 1
        stops = torch.tensor(dist.stop_token_ids, dtype=torch.long)
        tokens = torch.full((len(prompts), dist.max_new_tokens), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(prompts), dist.max_new_tokens)
        lengths = torch.full((len(prompts),), dist.max_new_tokens)
        active = torch.ones(len(prompts), dtype=torch.bool)
        for t in range(dist.max_new_tokens):
            rows = active.nonzero()[:, 0]
            logits = self._reply_logits(self.thinker.lm_head(h[rows.to(self.device)]), torch.full((len(rows),), t), dist)
            logp = sampling_logprobs(logits, dist)
            drawn = sample_tokens(logp, [generators[int(i)] for i in rows])
            tokens[rows, t] = drawn.cpu()
            logprobs[rows, t] = logp.gather(-1, drawn[:, None])[:, 0].cpu()
            stopped = torch.isin(drawn.cpu(), stops)
            lengths[rows[stopped]] = t + 1
            active[rows[stopped]] = False
            if not bool(active.any()) or t + 1 == dist.max_new_tokens:
                break
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
            positions = positions + 1
            h = self._thinker_hidden(tokens[:, t:t + 1].to(self.device), mask, cache, positions)[:, -1]
        return ([tokens[b, :n].clone() for b, n in enumerate(lengths.tolist())],
                [logprobs[b, :n].clone() for b, n in enumerate(lengths.tolist())])

    def _frames(self, prompts: Sequence[TokenPrompt], params: SamplingParams, generators: Sequence[torch.Generator]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
        """Each talker prompt's frames (T, K), their log-probs (T,) and whether the talker was cut before it stopped."""
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
        completions, values, truncated = [], [], []
        for b in range(len(conds)):
            stops = (codes_bt[b, :, 0] == self.codec_eos).nonzero()
            n = int(stops[0]) + 1 if len(stops) else codes_bt.shape[1]
            completion = codes_bt[b, :n].clone()
            if len(stops):
                completion[-1, 1:] = NO_CODE
            completions.append(completion)
            values.append(logp_bt[b, :n].float())
            truncated.append(not len(stops))
        return completions, values, truncated

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
        """Per-row log-probs of the completions: the frames' (``_frame_logprobs_under``), or, trained jointly, the
        reply's tokens' (``_reply_logprobs_under``) followed by the frames' spoken after that reply."""
        if not self.joint:
            return self._frame_logprobs_under(prompts, completions, distributions)
        split = [self._split(c.cpu()) for c in completions]
        replies = [r for r, _ in split]
        spoken = [self.spoken_prompt(p, r) for p, r in zip(prompts, replies)]
        thinker = self._reply_logprobs_under(prompts, replies, distributions)
        talker = self._frame_logprobs_under(spoken, [f for _, f in split], distributions)
        return [[torch.cat([a, b]) for a, b in zip(t, f)] for t, f in zip(thinker, talker)]

    def _reply_logprobs_under(self, prompts: Sequence[TokenPrompt], replies: Sequence[torch.Tensor],
                              distributions: Sequence[Sequence[SamplingParams]]) -> list[list[torch.Tensor]]:
        """Per-token log-probs of the thinker's replies, teacher-forced: one pass of its text decoder over [prompt,
        reply] per row (right-padded), under each row's reply distribution."""
        seqs = [torch.cat([p.input_ids, r.to(p.input_ids)]) for p, r in zip(prompts, replies)]
        ids, mask = pad_sequences(seqs, self.pad_token_id, "right")
        hidden = self._thinker_hidden(ids.to(self.device), mask.to(self.device))
        rows = torch.cat([torch.full((len(r),), i) for i, r in enumerate(replies)])
        cols = torch.cat([torch.arange(len(p.input_ids) - 1, len(p.input_ids) - 1 + len(r))
                          for p, r in zip(prompts, replies)])  # the state before token t predicts token t
        logits = self.thinker.lm_head(hidden[rows.to(self.device), cols.to(self.device)])
        tokens = torch.cat(list(replies)).to(self.device)
        index = torch.cat([torch.arange(len(r)) for r in replies])  # each token's place in its reply
        results = []
        for params in distributions:
            out = torch.zeros(len(tokens), dtype=torch.float32, device=logits.device)
            for sp in dict.fromkeys(params):
                idx = torch.isin(rows, torch.tensor([j for j, q in enumerate(params) if q == sp]))
                idx = idx.nonzero()[:, 0].to(self.device)
                dist = self._reply_distribution(sp)
                logp = sampling_logprobs(self._reply_logits(logits.index_select(0, idx), index[idx.cpu()], dist), dist)
                out = out.index_put((idx,), logp.gather(-1, tokens[idx][:, None])[:, 0])
            results.append(list(out.split([len(r) for r in replies])))
        return results

    def _frame_logprobs_under(self, prompts: Sequence[TokenPrompt], completions: Sequence[torch.Tensor],
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
