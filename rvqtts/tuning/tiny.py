"""A tiny random-weight Qwen3-TTS 12 Hz checkpoint (CustomVoice, Base or VoiceDesign), built offline with
qwen-tts's own classes.

Real weights cannot be downloaded everywhere (CI, air-gapped machines), yet every part of rvqtts must be
exercised through the ordinary loading path. This module writes a checkpoint folder that
`qwen_tts.Qwen3TTSModel.from_pretrained(folder)` loads like a real one: the real layout, the real
speaker and language names, shrunk dimensions, a tiny byte-level BPE text tokenizer and a tiny speech
tokenizer whose decoder makes audible (noisy) sound. Same arguments, byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rvqtts.qwen.compat import qwen_tts
from rvqtts.support.files import current_umask
from rvqtts.synthesis.settings import QWEN_TTS_DEFAULTS

SPEAKERS = ["vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee"]
LANGUAGES = "chinese english japanese korean german french russian portuguese spanish italian".split()
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>"]
# The Qwen2 pre-tokenizer pattern: it isolates "\n", so "assistant" and "\n" become single tokens,
# which qwen-tts relies on when it slices prompt token ids by position.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEXT_VOCAB = 512
DIMS = ("tiny", "0.6b", "1.7b")
# The released 12 Hz model kinds, as `make-tiny-model --kind` names them, and their config's tts_model_type.
KINDS = {"custom-voice": "custom_voice", "base": "base", "voice-design": "voice_design"}
# A speaker encoder small enough for tests: qwen-tts's ECAPA-TDNN needs equal middle channels divisible by
# its Res2Net scale (8), and a last channel count equal to their sum; its embedding is the talker's width.
TINY_SPEAKER_ENCODER = dict(enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_se_channels=16)
HEAD_DIM = 16
RELEASED = Path(__file__).parent / "released"  # the released models' configuration files, with provenance
TINY_SPEECH_TOKENIZER = Path(__file__).parent / "tiny-speech-tokenizer.json"
SHALLOW_LAYERS = 2  # `--shallow`: layers in the talker and in the code predictor
# qwen-tts reads generation_config.json as a plain dict of its own sampling keys; its defaults, and a short
# generation limit (the tiny talker never ends its speech).
GENERATION_DEFAULTS = {**QWEN_TTS_DEFAULTS, "max_new_tokens": 48}
# `--acceptance paper` (see _shape_paper_acceptance; measured in docs/acceptance.md). Scores are logits before
# the temperature; the values were tuned with the fixed seeds so that the measured acceptance lands near
# the paper's (1.70 codes per call with reused heads, 2.47 with offsets, at N = 32).
ACCEPTANCES = ("none", "paper")
PREFERENCE_SPREAD = (6.5, 4.5)  # spread of the preferred codes' scores at c1 and at c15 (linear between)
LOOKAHEAD_SHIFT = 3.6  # spread of the scores a head's drafts are off by per position they look ahead
CONTEXT_SPREAD = 1.4  # spread of the scores the previous code adds
LAYER_SCALE = 5e-4  # what is kept of each predictor layer's output projections
# Norms of the parts of a normed predictor input, whose norm is sqrt(hidden) (32 at the released width).
CARRIER_NORM, DRIFT_STEP, CONTEXT_NORM = 20.0, 1.0, 20.0
EMBEDDING_STD = 0.02  # HF's init std: the talker's inputs keep their usual size


def _build_text_tokenizer(out_dir: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["assistant\n", "user\n", "system\n", "Hello world. This is a tiny test of the text to speech model."]
    corpus = (corpus + ["The quick brown fox jumps over the lazy dog.", "Speak slowly and clearly, please."]) * 50
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = Qwen2TokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    ids = wrapped("<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    pieces, turn = wrapped.convert_ids_to_tokens(ids), ["<|im_start|>", "assistant", "Ċ"]
    if pieces[:3] != turn or pieces[-5:] != ["<|im_end|>", "Ċ", *turn]:
        raise RuntimeError(f"tiny tokenizer breaks qwen-tts's positional prompt layout: {pieces}")
    wrapped.save_pretrained(out_dir)
    return wrapped


def _codec_ids(codebook: int) -> tuple[int, dict[str, int], dict[str, int], dict[str, int]]:
    """Talker vocabulary and special ids. qwen-tts suppresses ids [vocab - 1024, vocab) for c0 except EOS,
    so vocab = codebook + 1024 and the specials sit above the codes, in the real model's relative layout."""
    names = ("pad", "bos", "eos_token", "think", "nothink", "think_bos", "think_eos")
    ids = {f"codec_{name}_id": codebook + n for name, n in zip(names, (100, 101, 102, 106, 107, 108, 109))}
    languages = {name: codebook + 2 + i for i, name in enumerate(LANGUAGES)}
    speakers = {name: codebook + 952 + i for i, name in enumerate(SPEAKERS)}
    return codebook + 1024, ids, languages, speakers


def _tiny_talker(
    codebook: int, code_groups: int, talker_hidden: int, predictor_hidden: int, predictor_layers: int
) -> tuple[dict, str]:
    """The talker config (with its code predictor's) of the tiny layout, and its tts_model_size."""
    vocab, ids, languages, speakers = _codec_ids(codebook)

    def block(hidden: int, layers: int, heads: int) -> dict:
        return dict(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            head_dim=hidden // heads,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            rope_theta=1000000,
            num_code_groups=code_groups,
        )

    # The talker's MRoPE sections need head_dim 16; the predictor keeps four heads at any width.
    talker = dict(
        **block(talker_hidden, 2, talker_hidden // HEAD_DIM),
        vocab_size=vocab,
        max_position_embeddings=32768,
        rope_scaling={"rope_type": "default", "interleaved": True, "mrope_section": [4, 2, 2]},
        text_hidden_size=32,
        spk_id=speakers,
        spk_is_dialect={name: False for name in speakers},
        codec_language_id=languages,
        position_id_per_seconds=13,
        code_predictor_config=dict(
            **block(predictor_hidden, predictor_layers, 4),
            vocab_size=codebook,
            max_position_embeddings=65536,
            rope_scaling=None,
        ),
        **ids,
    )
    return talker, "0b6"


def released_file(name: str) -> dict:
    """One of the released configuration files shipped in rvqtts/tuning/released/ (see its README)."""
    return json.loads((RELEASED / name).read_text())


def _released_talker(dims: str, layers: int | None) -> tuple[dict, str]:
    """The released talker config of a model size (with `layers`, that many in talker and code predictor)."""
    config = released_file(f"{dims}-customvoice-config.json")
    talker = config["talker_config"]
    if layers is not None:
        talker["num_hidden_layers"] = layers
        predictor = talker["code_predictor_config"]
        predictor["num_hidden_layers"] = layers
        predictor["layer_types"] = predictor["layer_types"][:layers]
    return talker, config["tts_model_size"]


def _shape_paper_acceptance(model, seed: int) -> None:
    """Set the code predictor's weights, and the talker's embedding of c0 (the predictor's input at position 1),
    so that the predictor's own sampling drafts about as well as the paper reports: the weights alone carry it.
    The construction is in docs/acceptance.md (a checkpoint with the paper's acceptance)."""
    predictor = model.talker.code_predictor
    hidden, codebook = predictor.config.hidden_size, predictor.config.vocab_size
    # the inputs of positions 1..16: the talker's embedding (its code rows, not its special ones), then c1..c15's
    tables = [model.talker.get_input_embeddings()] + list(predictor.model.codec_embedding)
    generator = torch.Generator().manual_seed(seed + 2)

    def gaussian(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    basis = torch.linalg.qr(gaussian(hidden, 3)).Q  # columns u, d, p

    def context(rows: int) -> torch.Tensor:  # random rows orthogonal to u, d and p
        part = gaussian(rows, hidden)
        return part - part @ basis @ basis.T

    centre = (len(tables) + 1) / 2
    with torch.no_grad():
        for position, table in enumerate(tables, 1):
            drift = (position - centre) * DRIFT_STEP
            pad = (hidden - CARRIER_NORM**2 - drift**2 - CONTEXT_NORM**2) ** 0.5
            rows = context(codebook)
            rows *= CONTEXT_NORM / rows.norm(dim=1, keepdim=True)
            rows += basis @ torch.tensor([CARRIER_NORM, drift, pad])
            table.weight[:codebook] = rows * EMBEDDING_STD
        # the expected order statistics of a standard normal: one shape of preference at every position
        normal_scores = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(codebook) + 0.5) / codebook)
        spreads = torch.linspace(*PREFERENCE_SPREAD, len(predictor.lm_head))
        for position, (head, spread) in enumerate(zip(predictor.lm_head, spreads), 1):
            preferred = normal_scores[torch.randperm(codebook, generator=generator)] * spread
            shift = gaussian(codebook) * LOOKAHEAD_SHIFT
            carrier = (preferred - (position - centre) * shift) / CARRIER_NORM
            weight = context(codebook) * (CONTEXT_SPREAD / CONTEXT_NORM)
            weight += torch.outer(carrier, basis[:, 0]) + torch.outer(shift / DRIFT_STEP, basis[:, 1])
            head.weight.copy_(weight)
        for layer in predictor.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LAYER_SCALE)


def _build_main_model(
    out_dir: Path,
    tokenizer,
    talker: dict,
    model_size: str,
    seed: int,
    dtype: torch.dtype,
    kind: str,
    small_encoder: bool,
    acceptance: str,
) -> None:
    models = qwen_tts().core.models
    token_id = tokenizer.convert_tokens_to_ids
    talker = dict(talker, text_vocab_size=TEXT_VOCAB)  # rvqtts's tiny text tokenizer
    extra = {}
    if kind != "custom-voice":  # Base and VoiceDesign have no built-in speakers
        talker.update(spk_id={}, spk_is_dialect={})
    if kind == "base":  # the speaker encoder whose x-vector stands where a speaker's embedding would
        extra["speaker_encoder_config"] = dict(
            enc_dim=talker["hidden_size"], **(TINY_SPEAKER_ENCODER if small_encoder else {})
        )
    config = models.Qwen3TTSConfig(
        talker_config=talker,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=model_size,
        tts_model_type=KINDS[kind],
        im_start_token_id=token_id("<|im_start|>"),
        im_end_token_id=token_id("<|im_end|>"),
        tts_pad_token_id=token_id("<|tts_pad|>"),
        tts_bos_token_id=token_id("<|tts_text_bos|>"),
        tts_eos_token_id=token_id("<|tts_text_eod|>"),
        architectures=["Qwen3TTSForConditionalGeneration"],
        **extra,
    )
    torch.manual_seed(seed)
    model = models.Qwen3TTSForConditionalGeneration(config).eval()
    predictor_hidden = config.talker_config.code_predictor_config.hidden_size
    with torch.no_grad():
        # HF init (std 0.02) gives nearly uniform code distributions; a wider spread in the predictor's
        # heads makes its distributions peaked enough for sampling and acceptance to be non-trivial.
        for head in model.talker.code_predictor.lm_head:
            head.weight.normal_(0.0, 1.0 / predictor_hidden**0.5 * 2.0)
    if acceptance == "paper":
        _shape_paper_acceptance(model, seed)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    config_path = out_dir / "config.json"
    saved = json.loads(config_path.read_text())
    # save_pretrained writes "model_type": "" into the speaker encoder config, which then fails to reload.
    saved["speaker_encoder_config"].pop("model_type", None)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _tiny_speech_tokenizer_config(codebook: int, code_groups: int):
    """A shrunk speech tokenizer config (the decoder's cost and sound do not matter to tests): the Mimi encoder and
    12 Hz decoder of tiny-speech-tokenizer.json, whose rates are the released ones (24 kHz <-> 12.5 Hz, 1920 samples
    a frame), with this model's codebook and code groups."""
    config = json.loads(TINY_SPEECH_TOKENIZER.read_text())
    for part in ("encoder_config", "decoder_config"):
        config[part].update(codebook_size=codebook, num_quantizers=code_groups)
    return qwen_tts().core.Qwen3TTSTokenizerV2Config(**config, encoder_valid_num_quantizers=code_groups)


def _build_speech_tokenizer(out_dir: Path, config, seed: int) -> None:
    """The speech tokenizer (Mimi encoder and 12 Hz decoder) of `config`, with weights that make noise."""
    from transformers import EncodecFeatureExtractor

    core = qwen_tts().core
    folder = out_dir / "speech_tokenizer"
    folder.mkdir()
    torch.manual_seed(seed + 1)
    model = core.Qwen3TTSTokenizerV2Model(config).eval()
    with torch.no_grad():
        # The codebooks start as zeros and HF's init makes the decoder nearly silent (about 3e-5 peak):
        # PyTorch's default init and random codebooks make audible noise instead.
        for module in model.decoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
                module.reset_parameters()
        for name, parameter in model.named_parameters():
            if name.endswith("embedding_sum"):
                parameter.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("embed_sum"):
                buffer.normal_(0.0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(folder)


def _check_build_options(dims: str, kind: str, layers: int | None, acceptance: str, codebook: int, code_groups: int):
    """ValueError, naming the option, for a combination build_tiny_model cannot build."""
    named = {"--dims": (dims, DIMS), "--kind": (kind, KINDS), "--acceptance": (acceptance, ACCEPTANCES)}
    for option, (value, choices) in named.items():
        if value not in choices:
            raise ValueError(f"{option} must be one of {', '.join(choices)}, got {value!r}")
    if kind == "voice-design" and dims == "0.6b":
        raise ValueError("VoiceDesign is released at 1.7B only: use --dims 1.7b or --dims tiny")
    if layers is not None and dims == "tiny":
        raise ValueError("--shallow keeps the released widths: use it with --dims 0.6b or --dims 1.7b")
    if layers is not None and layers < 1:
        raise ValueError(f"a shallow checkpoint needs at least one layer, got {layers}")
    if acceptance == "paper" and dims != "0.6b":
        raise ValueError("--acceptance paper is tuned for the released 0.6B code predictor: use it with --dims 0.6b")
    if dims != "tiny" and (codebook, code_groups) != (2048, 16):
        raise ValueError("--codebook and --code-groups apply to --dims tiny; the released models have 2048 and 16")
    for option, value, most in (("--codebook", codebook, 65536), ("--code-groups", code_groups, 32)):
        if not 2 <= value <= most:
            raise ValueError(f"{option} must be between 2 and {most}, got {value}")


def build_tiny_model(
    out_dir: str | os.PathLike,
    codebook: int = 2048,
    code_groups: int = 16,
    seed: int = 0,
    talker_hidden: int = 64,
    predictor_hidden: int | None = None,
    predictor_layers: int = 2,
    dims: str = "tiny",
    layers: int | None = None,
    kind: str = "custom-voice",
    acceptance: str = "none",
) -> Path:
    """Write a random-weight checkpoint to `out_dir` (which must not exist or be empty) and return its path.

    The options are `rvqtts make-tiny-model`'s (docs/usage.md, docs/model-kinds.md); `layers` is `--shallow`'s
    SHALLOW_LAYERS. At `dims="tiny"`, a `predictor_hidden` other than `talker_hidden` gives the 1.7B layout, with a
    projection in front of the code predictor.
    """
    _check_build_options(dims, kind, layers, acceptance, codebook, code_groups)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} already exists and is not an empty folder: choose another path, remove it, "
            f"or pass --force to replace it"
        )
    # Build beside the target and rename at the end, so an interrupted build leaves nothing half-written.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = _build_text_tokenizer(staging)
        if dims == "tiny":
            talker, model_size = _tiny_talker(
                codebook, code_groups, talker_hidden, predictor_hidden or talker_hidden, predictor_layers
            )
            generation, dtype = GENERATION_DEFAULTS, torch.float32
        else:
            talker, model_size = _released_talker(dims, layers)
            generation, dtype = released_file("generation_config.json"), torch.bfloat16
        if kind == "voice-design":
            model_size = "1b7"  # its only released size (qwen-tts drops instructions for a 0.6B's)
        small = dims == "tiny" or layers is not None  # a small speaker encoder and speech tokenizer
        _build_main_model(staging, tokenizer, talker, model_size, seed, dtype, kind, small, acceptance)
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if small:
            speech = _tiny_speech_tokenizer_config(codebook, code_groups)
        else:
            speech = qwen_tts().core.Qwen3TTSTokenizerV2Config.from_dict(released_file("speech_tokenizer-config.json"))
        _build_speech_tokenizer(staging, speech, seed)
        if out.exists():
            out.rmdir()
        staging.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700; give the folder ordinary permissions
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
