// rvqtts's page: speaks text through the server's streaming API (server-sent events carrying 16-bit PCM), playing
// each piece as it comes, and uploads voices on a Base model. Whatever comes from the server or the user is only
// ever set as text (textContent, new Option), never as markup. URLs are relative: the page is served by its server.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "rvqtts.apiKey"; // sessionStorage: the key lasts as long as the tab
let retry = null; // what to run again once an API key is given
let speaking = null; // the AbortController of the request streaming now
let result = null; // the last finished speech: {pieces, sampleRate, body}
let recorded = null; // the microphone's recording as WAV: {blob, seconds}
let recorder = null; // the MediaRecorder while recording

function say(message, kind = "") {
  $("status").textContent = message;
  $("status").className = kind;
}

// ---- Requests ----

class ApiError extends Error {}
class NeedsKey extends Error {}

// fetch with the API key; on 401 the key is asked for and `again` runs once it is given.
async function api(path, options, again) {
  const headers = new Headers(options?.headers);
  const key = sessionStorage.getItem(KEY);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...options, headers });
  if (response.ok) return response;
  const message = await errorMessage(response);
  if (response.status === 401) {
    askKey(message, again);
    throw new NeedsKey(message);
  }
  throw new ApiError(message);
}

// The server's own message ({"error": {"message": ...}}), else the status line.
async function errorMessage(response) {
  const text = await response.text().catch(() => "");
  try {
    const message = JSON.parse(text).error.message;
    if (message) return String(message);
  } catch {}
  return `The server answered ${response.status} ${response.statusText}`.trim();
}

function failed(error) {
  if (error instanceof NeedsKey || error.name === "AbortError") return; // the key form or Stop says why
  const prefix = error instanceof TypeError ? "The server cannot be reached: " : ""; // fetch's network error
  say(error instanceof ApiError ? error.message : prefix + error.message, "error");
}

function askKey(message, again) {
  retry = again;
  say(message, "error");
  $("api-key-form").hidden = false;
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("api-key").value.trim());
  $("api-key").value = "";
  $("api-key-form").hidden = true;
  say("");
  const again = retry || loadVoices;
  retry = null;
  again();
}

// ---- The model's choices ----

async function loadVoices(selected) {
  let model;
  try {
    model = await (await api("v1/audio/voices", {}, () => loadVoices(selected))).json();
  } catch (error) {
    return failed(error);
  }
  const kinds = { custom_voice: "CustomVoice", base: "Base", voice_design: "VoiceDesign" };
  $("model").textContent = `Model: ${model.model} (${kinds[model.kind] || model.kind})`;
  const voices = model.voices || [];
  fill($("voice"), voices, selected ?? $("voice").value);
  fill($("language"), model.languages?.length ? model.languages : ["auto"], $("language").value || "auto");
  $("voice-field").hidden = model.kind === "voice_design"; // its voice is its instructions
  $("instructions-field").hidden = !(model.instructions ?? model.kind === "voice_design");
  $("voices-panel").hidden = !model.uploads;
  $("delete-voice").disabled = !voices.length;
  if (model.kind === "base" && !voices.length) {
    say(model.uploads ? "No voices yet: upload one below." : "This server has no voices (start it with --voices DIR).");
  }
}

function fill(select, values, selected) {
  select.replaceChildren(...values.map((value) => new Option(value, value))); // text, never markup
  if (values.includes(selected)) select.value = selected;
}

// ---- Speaking ----

// Plays 16-bit PCM pieces back to back: each starts where the one before ends (or now, where it came late).
const player = {
  context: null,
  start: 0,
  end: 0,
  sources: new Set(),
  reset() {
    this.stop();
    this.start = this.end = 0;
  },
  play(bytes, sampleRate) {
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const count = bytes.byteLength >> 1; // the server sends whole samples
    if (!count) return;
    const buffer = this.context.createBuffer(1, count, sampleRate);
    const samples = buffer.getChannelData(0);
    for (let i = 0; i < count; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const at = Math.max(this.end, this.context.currentTime + 0.05); // a short lead: no click, no overlap
    if (!this.start) this.start = at;
    source.start(at);
    source.onended = () => this.sources.delete(source);
    this.sources.add(source);
    this.end = at + buffer.duration;
  },
  stop() {
    for (const source of this.sources) source.stop();
    this.sources.clear();
    if (this.context) this.end = Math.min(this.end, this.context.currentTime);
  },
  played() {
    if (!this.start) return 0;
    return Math.max(0, Math.min(this.context.currentTime, this.end) - this.start);
  },
};

// For tests: how far playback has got, in seconds of the AudioContext's clock.
window.rvqttsPlayer = Object.freeze({ playedSeconds: () => player.played() });

// The request's fields, the same for the streamed request and a download in another format.
function fields() {
  const body = { input: $("text").value, language: $("language").value, speed: Number($("speed").value) };
  if (!$("voice-field").hidden && $("voice").value) body.voice = $("voice").value;
  if (!$("instructions-field").hidden && $("instructions").value.trim()) body.instructions = $("instructions").value;
  const seed = $("seed").value;
  body.seed = seed === "" ? Math.floor(Math.random() * 2 ** 31) : Number(seed); // kept: a download says the same
  return body;
}

async function speak(event) {
  event.preventDefault();
  if (speaking) return;
  // Created on the click: browsers let audio start only from a user's gesture.
  player.context ??= new AudioContext();
  player.context.resume();
  player.reset();
  const body = fields();
  const controller = (speaking = new AbortController());
  result = null;
  showStats({}, { seed: body.seed });
  setSpeaking(true);
  say("Speaking…", "busy");
  const sent = performance.now();
  try {
    const request = { ...body, response_format: "pcm", stream: true, stream_format: "sse" };
    const response = await api(
      "v1/audio/speech",
      { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request), signal: controller.signal },
      () => $("speak-form").requestSubmit(),
    );
    let sampleRate = Number(response.headers.get("X-Sample-Rate")) || 24000;
    const pieces = [];
    const stats = await readEvents(response, (bytes) => {
      if (!pieces.length) $("first-audio").textContent = seconds((performance.now() - sent) / 1000); // until the server's figure
      pieces.push(bytes);
      player.play(bytes, sampleRate);
    });
    sampleRate = stats.sample_rate || sampleRate;
    const audioSeconds = pieces.reduce((n, piece) => n + piece.byteLength, 0) / 2 / sampleRate;
    showStats(stats, { seed: body.seed, audioSeconds });
    result = { pieces, sampleRate, body };
    say(`Done: ${audioSeconds.toFixed(2)} s of audio.`, "ok");
  } catch (error) {
    failed(error);
  } finally {
    speaking = null;
    setSpeaking(false);
  }
}

// Reads the server-sent events, handing each piece's PCM to `onAudio`; returns the done event's stats. A stream
// that breaks or ends without its done event is an error: the server stopped or cut it.
async function readEvents(response, onAudio) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let text = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ApiError(`The stream broke before its end (${error.message}): the server may have stopped.`);
    }
    if (chunk.done) throw new ApiError("The stream ended before the audio was done: the server may have stopped.");
    text += chunk.value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = text.indexOf("\n\n")) >= 0) {
      const data = text.slice(0, end).split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trim()).join("\n");
      text = text.slice(end + 2);
      if (!data) continue;
      const event = JSON.parse(data);
      if (event.type === "speech.audio.delta") onAudio(Uint8Array.from(atob(event.audio), (c) => c.charCodeAt(0)));
      else if (event.type === "speech.audio.done") return event.stats || {};
      else if (event.type === "error") throw new ApiError(event.error?.message || "The synthesis failed.");
    }
  }
}

function stop() {
  speaking?.abort();
  player.stop();
  say("Stopped.");
}

function setSpeaking(on) {
  $("speak").disabled = on;
  $("stop").disabled = !on;
  $("download").disabled = on || !result;
}

const seconds = (value) => (value == null ? "–" : `${Number(value).toFixed(2)} s`);
const number = (value, digits) => (value == null ? "–" : Number(value).toFixed(digits));

function showStats(stats, { seed, audioSeconds }) {
  if (stats.first_audio_seconds != null || !Object.keys(stats).length) $("first-audio").textContent = seconds(stats.first_audio_seconds);
  $("rtf").textContent = number(stats.real_time_factor, 2);
  $("codes-per-call").textContent = number(stats.codes_per_call, 2);
  $("audio-seconds").textContent = seconds(stats.audio_seconds ?? audioSeconds);
  $("seed-used").textContent = String(seed);
}

// ---- Downloading ----

async function download() {
  if (!result) return;
  const format = $("format").value;
  if (format === "wav") return save(wav(result.pieces, result.sampleRate), "speech.wav");
  // The server encodes the other formats: the same request again, whole, with the same seed.
  $("download").disabled = true;
  say(`Making the ${format} file…`, "busy");
  try {
    const request = { ...result.body, response_format: format, stream: false };
    const response = await api(
      "v1/audio/speech",
      { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request) },
      download,
    );
    save(await response.blob(), `speech.${format}`);
    say(`Downloaded speech.${format}.`, "ok");
  } catch (error) {
    failed(error);
  } finally {
    $("download").disabled = !result;
  }
}

function save(blob, name) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60000);
}

// A WAV file: the 44-byte header of 16-bit mono PCM, then the samples.
function wav(parts, sampleRate) {
  const size = parts.reduce((n, part) => n + part.byteLength, 0);
  const header = new DataView(new ArrayBuffer(44));
  const ascii = (at, text) => [...text].forEach((c, i) => header.setUint8(at + i, c.charCodeAt(0)));
  ascii(0, "RIFF");
  header.setUint32(4, 36 + size, true);
  ascii(8, "WAVEfmt ");
  header.setUint32(16, 16, true); // the fmt chunk's size
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, sampleRate, true);
  header.setUint32(28, sampleRate * 2, true); // bytes per second
  header.setUint16(32, 2, true); // bytes per sample
  header.setUint16(34, 16, true); // bits per sample
  ascii(36, "data");
  header.setUint32(40, size, true);
  return new Blob([header, ...parts], { type: "audio/wav" });
}

// ---- Voices (a Base model with --voices) ----

async function record() {
  if (recorder) return recorder.stop(); // the second press ends the recording
  if (!navigator.mediaDevices?.getUserMedia || !window.MediaRecorder) {
    return say("Recording needs this page on localhost or over HTTPS: the browser offers no microphone here. Choose a file instead.", "error");
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (error) {
    return say(`The microphone is not available (${error.name}: ${error.message}). Choose a file instead.`, "error");
  }
  const parts = [];
  const current = (recorder = new MediaRecorder(stream));
  const limit = setTimeout(() => current.state === "recording" && current.stop(), 60000); // the server takes 60 s at most
  current.ondataavailable = (event) => parts.push(event.data);
  current.onstop = async () => {
    clearTimeout(limit);
    stream.getTracks().forEach((track) => track.stop());
    recorder = null;
    setRecording(false);
    try {
      recorded = await toWav(new Blob(parts, { type: current.mimeType }));
      $("voice-file").value = ""; // the recording replaces a chosen file
      $("recording").src = URL.createObjectURL(recorded.blob);
      $("recording").hidden = false;
      say(`Recorded ${recorded.seconds.toFixed(1)} s: name the voice and upload it.`, "ok");
    } catch (error) {
      say(`The recording cannot be read: ${error.message}`, "error");
    }
  };
  current.start();
  setRecording(true);
  say("Recording… press Stop recording when done.", "busy");
}

function setRecording(on) {
  $("record").textContent = on ? "Stop recording" : "Record";
  $("record").classList.toggle("recording", on);
}

// MediaRecorder's WebM/Opus decoded by the browser and written as 16-bit mono WAV at 24 kHz, which the server reads.
async function toWav(blob) {
  const decoded = await new OfflineAudioContext(1, 1, 24000).decodeAudioData(await blob.arrayBuffer());
  const mono = new Float32Array(decoded.length);
  for (let c = 0; c < decoded.numberOfChannels; c++) {
    decoded.getChannelData(c).forEach((x, i) => (mono[i] += x / decoded.numberOfChannels));
  }
  const pcm = new DataView(new ArrayBuffer(mono.length * 2));
  mono.forEach((x, i) => pcm.setInt16(2 * i, Math.round(Math.max(-1, Math.min(1, x)) * 32767), true));
  return { blob: wav([pcm], decoded.sampleRate), seconds: decoded.duration };
}

function chooseFile() {
  recorded = null; // a chosen file replaces a recording
  $("recording").hidden = true;
}

async function upload(event) {
  event.preventDefault();
  const name = $("voice-name").value.trim();
  const file = $("voice-file").files[0];
  if (!file && !recorded) return say("Choose a recording's file, or record one, first.", "error");
  const form = new FormData();
  form.append("name", name);
  form.append("audio_sample", file || recorded.blob, file ? file.name : "recording.wav");
  const transcript = $("voice-transcript").value.trim();
  if (transcript) form.append("ref_text", transcript);
  setVoiceBusy(true);
  say(`Uploading the voice ${name}… (the server encodes it)`, "busy");
  try {
    const response = await api("v1/audio/voices", { method: "POST", body: form }, () => $("upload-form").requestSubmit());
    const voice = await response.json();
    await loadVoices(voice.name);
    say(`The voice ${voice.name} is ready (${voice.mode}, from ${voice.seconds} s of audio).`, "ok");
    $("upload-form").reset();
    chooseFile();
  } catch (error) {
    failed(error);
  } finally {
    setVoiceBusy(false);
  }
}

async function deleteVoice() {
  const name = $("voice").value;
  if (!name) return say("Choose the voice to delete in the Voice list.", "error");
  if (!confirm(`Delete the voice “${name}”? Requests can no longer name it.`)) return;
  setVoiceBusy(true);
  try {
    await api(`v1/audio/voices/${encodeURIComponent(name)}`, { method: "DELETE" }, deleteVoice);
    await loadVoices();
    say(`The voice ${name} is deleted.`, "ok");
  } catch (error) {
    failed(error);
  } finally {
    setVoiceBusy(false);
  }
}

function setVoiceBusy(on) {
  $("upload").disabled = on;
  $("delete-voice").disabled = on || !$("voice").options.length;
}

// ---- Wiring ----

$("api-key-form").addEventListener("submit", useKey);
$("speak-form").addEventListener("submit", speak);
$("stop").addEventListener("click", stop);
$("download").addEventListener("click", download);
$("record").addEventListener("click", record);
$("voice-file").addEventListener("change", chooseFile);
$("upload-form").addEventListener("submit", upload);
$("delete-voice").addEventListener("click", deleteVoice);
$("text").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("speak-form").requestSubmit(); // Ctrl+Enter speaks
});
loadVoices();
