// The mlx-voicechat page: microphone -> the server (OpenAI Realtime, GA event names) ->
// speaker, with the user's and the model's words, the function channel and a timeline.
// WebRTC by default (POST /v1/realtime/calls: Opus both ways with the browser's own jitter
// buffer and echo cancellation, the events on the oai-events data channel); the WebSocket
// /v1/realtime when WebRTC fails or the server does not offer it.
// The page never holds the server's API key: when the server has one, the page connects with a
// short-lived client secret (ek_..., minted by a back-end with POST /v1/realtime/client_secrets),
// typed in or given in the address's fragment (#secret=ek_..., which never reaches a server's
// logs; the page removes it from the address bar). A server without a key needs none.
// No build step and nothing fetched from elsewhere: this file, resampler.js and the two
// worklets are all there is.
(() => {
  'use strict';

  const FRAME_MS = 80; // one model frame
  const WEBRTC_POST_MS = 8000; // the offer's POST; then the WebSocket
  const SECRET_PREFIX = 'ek_'; // a client secret; anything else would be the server's key
  const NEEDS_SECRET = 'this server needs a client secret (ek_...): open the page from your back-end (it adds #secret=ek_... to the address) or paste one in Settings';
  const OUTPUT_RATE = 24000; // asked of the server; the playback worklet resamples to the device
  const TIMELINE_SECONDS = 12;
  const BUSY_TEXT = 'the model is busy, try again';
  const UPDATE_ID = 'page_session_update'; // names our session.update in the server's errors
  const base = new URL('.', document.currentScript.src);

  // Kept current for tests and for people curious in the console.
  const vc = {
    state: 'idle', // idle | connecting | connected | busy | closed | error
    framesSent: 0,
    framesReceived: 0,
    framesPlayed: 0,
    framesDropped: 0,
    underruns: 0,
    userText: '',
    assistantText: '',
    functionText: '',
    toolCalls: [],
    lastError: null,
    latencyMs: null,
    fps: null,
    rtf: null,
    lagMs: null,
    serverFrames: null,
    speaking: false,
    closeCode: null,
    sessionId: null,
    inputRate: null,
    contextRate: null,
    mode: 'realtime', // realtime | transcription (a recognizer server's sessions always are)
    transport: null, // webrtc | websocket
    rttMs: null, // WebRTC's round-trip time (the ICE candidate pair's)
    webrtcError: null, // why WebRTC was not used, when the page fell back to the WebSocket
    webrtcConnectMs: 8000, // ICE, DTLS and the data channel after the answer; then the WebSocket
    secretUsed: false, // the client secret admitted a connection (it admits no other)
  };
  window.voicechat = vc;

  const $ = (id) => document.getElementById(id);
  const ui = {
    start: $('start'), stop: $('stop'), interrupt: $('interrupt'), status: $('status'),
    error: $('error'), instructions: $('instructions'), secret: $('secret'), rate: $('rate'),
    latency: $('latency'), fps: $('fps'), rtf: $('rtf'), lag: $('lag'), counts: $('counts'),
    buffer: $('buffer'), user: $('user'), assistant: $('assistant'), function: $('function'),
    canvas: $('timeline'), model: $('model'), settings: $('settings'), mode: $('mode'),
    transport: $('transport'), transportInfo: $('transport-info'),
  };
  const transcribing = () => vc.mode === 'transcription';

  let conn = null; // everything one conversation holds; null when stopped
  let modelId = null;

  // ---------------------------------------------------------------- status and errors
  function setState(state, text) {
    vc.state = state;
    ui.status.className = `status ${state}`;
    ui.status.textContent = text;
  }

  function showError(message) {
    vc.lastError = message;
    ui.error.textContent = message;
    ui.error.hidden = false;
  }

  function clearError() {
    ui.error.hidden = true;
    ui.error.textContent = '';
  }

  function setRunning(running) {
    ui.start.disabled = running;
    ui.stop.disabled = !running;
    ui.interrupt.disabled = !running;
    ui.instructions.disabled = running;
    ui.secret.disabled = running;
    ui.rate.disabled = running;
  }

  // ---------------------------------------------------------------- transcript panes
  class Log {
    constructor(element, onChange) {
      this.element = element;
      this.entries = new Map();
      this.onChange = onChange;
    }

    entry(id, label) {
      let entry = this.entries.get(id);
      if (!entry) {
        const div = document.createElement('div');
        div.className = 'entry live';
        if (label) {
          const tag = document.createElement('span');
          tag.className = 'tag';
          tag.textContent = label;
          div.appendChild(tag);
        }
        const text = document.createElement('span');
        text.className = 'text';
        div.appendChild(text);
        this.element.appendChild(div);
        entry = { div, text, value: '' };
        this.entries.set(id, entry);
      }
      return entry;
    }

    append(id, delta, label) {
      const entry = this.entry(id, label);
      entry.value += delta;
      this.render(entry);
    }

    set(id, value, label) {
      const entry = this.entry(id, label);
      entry.value = value;
      this.render(entry);
    }

    finish(id, note) {
      const entry = this.entries.get(id);
      if (!entry) return;
      entry.div.classList.remove('live');
      if (note) {
        entry.div.classList.add(note);
      }
    }

    render(entry) {
      // Control characters (a random-weight model emits them) are not text: not shown.
      entry.text.textContent = entry.value.replace(/[\u0000-\u0008\u000b-\u001f\u007f-\u009f]/g, '');
      const el = this.element;
      if (el.scrollHeight - el.scrollTop - el.clientHeight < 60) el.scrollTop = el.scrollHeight;
      this.onChange(this.text());
    }

    text() {
      return Array.from(this.entries.values(), (e) => e.value).filter((v) => v).join('\n');
    }

    reset() {
      this.entries.clear();
      this.element.textContent = '';
      this.onChange('');
    }
  }

  const userLog = new Log(ui.user, (t) => { vc.userText = t; });
  const assistantLog = new Log(ui.assistant, (t) => { vc.assistantText = t; });
  const functionLog = new Log(ui.function, (t) => { vc.functionText = t; });

  // ---------------------------------------------------------------- timeline
  // One column per 80 ms frame: input level up, output level down, the server's lag as a line.
  const timeline = {
    columns: [],
    push(column) {
      this.columns.push(column);
      const keep = Math.round((TIMELINE_SECONDS * 1000) / FRAME_MS);
      if (this.columns.length > keep) this.columns.splice(0, this.columns.length - keep);
    },
  };
  let pendingInput = 0;
  let pendingOutput = 0;

  function levelToUnit(rms) {
    if (!(rms > 0)) return 0;
    const db = 20 * Math.log10(rms);
    return Math.max(0, Math.min(1, (db + 60) / 60)); // -60 dBFS .. 0 dBFS
  }

  function drawTimeline() {
    const canvas = ui.canvas;
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * dpr));
    const height = Math.max(1, Math.round(canvas.clientHeight * dpr));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const g = canvas.getContext('2d');
    const css = getComputedStyle(document.documentElement);
    const color = (name) => css.getPropertyValue(name).trim();
    g.clearRect(0, 0, width, height);
    const keep = Math.round((TIMELINE_SECONDS * 1000) / FRAME_MS);
    const w = width / keep;
    const mid = height / 2;
    const cols = timeline.columns;
    const x0 = width - cols.length * w;
    for (let i = 0; i < cols.length; i++) {
      const c = cols[i];
      const x = x0 + i * w;
      if (c.speaking) {
        g.fillStyle = color('--turn');
        g.fillRect(x, 0, Math.ceil(w), height);
      }
      g.fillStyle = color('--in');
      const hi = levelToUnit(c.input) * (mid - 2);
      g.fillRect(x, mid - hi, Math.max(1, w - 1), hi);
      g.fillStyle = color('--out');
      const ho = levelToUnit(c.output) * (mid - 2);
      g.fillRect(x, mid, Math.max(1, w - 1), ho);
    }
    // Lag line, scaled to the larger of 1 s and the largest lag shown.
    const lags = cols.map((c) => c.lag).filter((v) => v != null);
    if (lags.length) {
      const top = Math.max(500, ...lags);
      g.strokeStyle = color('--lag');
      g.lineWidth = Math.max(1, dpr * 1.5);
      g.beginPath();
      let started = false;
      for (let i = 0; i < cols.length; i++) {
        if (cols[i].lag == null) continue;
        const x = x0 + (i + 0.5) * w;
        const y = height - 1 - (cols[i].lag / top) * (height - 2);
        if (started) g.lineTo(x, y);
        else { g.moveTo(x, y); started = true; }
      }
      g.stroke();
    }
    g.fillStyle = color('--axis');
    g.fillRect(0, Math.round(mid), width, Math.max(1, Math.round(dpr)));
  }

  function animate() {
    drawTimeline();
    requestAnimationFrame(animate);
  }

  function tickTimeline() {
    if (!conn) return;
    timeline.push({
      input: pendingInput,
      output: pendingOutput,
      lag: vc.lagMs,
      speaking: vc.speaking,
    });
    pendingInput = 0;
    pendingOutput = 0;
    updateMetrics();
  }

  // ---------------------------------------------------------------- metrics
  function fmt(value, digits, unit) {
    return value == null || !isFinite(value) ? '–' : `${value.toFixed(digits)}${unit || ''}`;
  }

  function updateMetrics() {
    if (conn) {
      const now = performance.now();
      const recent = conn.receivedTimes;
      while (recent.length && now - recent[0] > 2000) recent.shift();
      if (!conn.serverFps) vc.fps = recent.length / Math.max(0.08, Math.min(2, (now - conn.openedAt) / 1000));
    }
    ui.latency.textContent = vc.latencyMs == null ? '–' : `${(vc.latencyMs / 1000).toFixed(2)} s`;
    ui.fps.textContent = fmt(vc.fps, 1);
    ui.rtf.textContent = fmt(vc.rtf, 2);
    ui.lag.textContent = vc.lagMs == null ? '–' : `${Math.round(vc.lagMs)} ms`;
    ui.counts.textContent = `${vc.framesSent} / ${vc.framesReceived} / ${vc.framesPlayed}`;
    ui.transportInfo.textContent = vc.transport
      ? `${vc.transport === 'webrtc' ? 'WebRTC' : 'WebSocket'}${vc.rttMs == null ? '' : `, RTT ${Math.round(vc.rttMs)} ms`}`
      : '–';
    if (conn && conn.player) {
      const p = conn.playerStats;
      ui.buffer.textContent = p
        ? `${Math.round(p.queuedSeconds * 1000)} / ${Math.round(p.targetSeconds * 1000)} ms, ${p.underruns} underrun${p.underruns === 1 ? '' : 's'}`
        : '–';
    }
  }

  // Vendor statistics: the protocol lets servers add their own events and fields; read the
  // lag / compute time from whichever the server sends, if any.
  function readStats(event) {
    const s = event.stats || event.metrics || event;
    const pick = (...names) => {
      for (const n of names) if (typeof s[n] === 'number') return s[n];
      return null;
    };
    const lagMs = pick('lag_ms');
    const lagS = pick('lag_seconds', 'lag_s', 'lag');
    if (lagMs != null) vc.lagMs = lagMs;
    else if (lagS != null) vc.lagMs = lagS * 1000;
    const rtf = pick('rtf', 'real_time_factor');
    const computeMs = pick('compute_ms', 'frame_ms', 'step_ms');
    if (rtf != null) vc.rtf = rtf;
    else if (computeMs != null) vc.rtf = computeMs / FRAME_MS;
    // Frames per second: the server's own figure, else from its running frame count.
    let fps = pick('fps', 'frames_per_second');
    const frames = pick('frames');
    if (fps == null && frames != null && conn) {
      const now = performance.now();
      const prev = conn.statsMark;
      conn.statsMark = { frames, now };
      if (prev && now > prev.now && frames >= prev.frames) fps = ((frames - prev.frames) * 1000) / (now - prev.now);
    }
    if (fps != null && conn) {
      vc.fps = fps;
      conn.serverFps = true;
    }
    if (frames != null) vc.serverFrames = frames;
  }

  // ---------------------------------------------------------------- PCM helpers
  function int16ToBase64(pcm) {
    const bytes = new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
    let binary = '';
    const chunk = 0x8000;
    for (let i = 0; i < bytes.length; i += chunk) {
      binary += String.fromCharCode.apply(null, bytes.subarray(i, i + chunk));
    }
    return btoa(binary);
  }

  function base64ToFloat32(b64) {
    const binary = atob(b64);
    const n = binary.length >> 1;
    const out = new Float32Array(n);
    for (let i = 0; i < n; i++) {
      let v = binary.charCodeAt(2 * i) | (binary.charCodeAt(2 * i + 1) << 8);
      if (v >= 0x8000) v -= 0x10000;
      out[i] = v / 32768;
    }
    return out;
  }

  // ---------------------------------------------------------------- the conversation
  function send(event) {
    if (conn && conn.dc && conn.dc.readyState === 'open') {
      conn.dc.send(JSON.stringify(event));
      return true;
    }
    if (conn && conn.ws && conn.ws.readyState === WebSocket.OPEN) {
      conn.ws.send(JSON.stringify(event));
      return true;
    }
    return false;
  }

  function describeMediaError(error) {
    const name = error && error.name;
    if (name === 'NotAllowedError' || name === 'SecurityError') {
      return 'microphone access was refused: allow it for this page (and open the page over https or at localhost)';
    }
    if (name === 'NotFoundError' || name === 'OverconstrainedError') return 'no microphone was found';
    if (name === 'NotReadableError') return 'the microphone is in use by another program or cannot be read';
    return `the microphone could not be opened: ${error && error.message ? error.message : error}`;
  }

  function describeClose(code, reason, opened) {
    if (code === 1013) return BUSY_TEXT;
    if (code === 1008 || code === 4001 || code === 4003) {
      return reason ? `the server refused the connection: ${reason}` : 'the server refused the connection (check the client secret)';
    }
    if (code === 1006 && !opened) {
      return 'the server refused the connection: a missing, expired or used client secret, this page\'s origin not allowed, or no server at this address';
    }
    if (code === 1006) return 'the connection to the server was lost';
    if (code === 1009) return 'the server refused a message as too large';
    if (code === 1011) return `the server hit an internal error${reason ? `: ${reason}` : ''}`;
    if (code === 4408) return 'the server closed the connection: no audio arrived for a while (press Start to talk again)';
    return `the server closed the connection (code ${code}${reason ? `: ${reason}` : ''})`;
  }

  async function start() {
    vc.mode = ui.mode.value;
    if (conn) return;
    clearError();
    vc.lastError = null;
    const secret = ui.secret.value.trim();
    if (secret && !secret.startsWith(SECRET_PREFIX)) {
      // Never sent: the server's key does not belong in a page.
      showError('the page refused that credential: it takes a client secret (ek_...) from your back-end, never the server\'s API key');
      setState('error', 'not connected');
      return;
    }
    if (!window.isSecureContext || !navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      showError('the microphone needs a secure page: open it at http://127.0.0.1:PORT/ or http://localhost:PORT/, or over https (serve --ssl-certfile CERT --ssl-keyfile KEY)');
      return;
    }
    const Context = window.AudioContext || window.webkitAudioContext;
    if (!Context) {
      showError('this browser has no Web Audio API');
      return;
    }
    setRunning(true);
    setState('connecting', 'connecting…');
    userLog.reset();
    assistantLog.reset();
    functionLog.reset();
    Object.assign(vc, {
      framesSent: 0, framesReceived: 0, framesPlayed: 0, framesDropped: 0, underruns: 0,
      toolCalls: [], latencyMs: null, fps: null, rtf: null, lagMs: null, serverFrames: null, speaking: false,
      closeCode: null, sessionId: null, transport: null, rttMs: null, webrtcError: null,
      secretUsed: false,
    });
    timeline.columns = [];
    const c = {
      ws: null, ctx: null, stream: null, source: null, capture: null, player: null,
      playerStats: null, ready: false, micStart: null, firstAudio: false,
      receivedTimes: [], openedAt: performance.now(), serverFps: false,
      responses: new Map(), functionCalls: new Map(), closing: false, secret,
    };
    conn = c;
    const inputRate = Number(ui.rate.value) || 24000;
    vc.inputRate = inputRate;
    try {
      // The context runs at the device's own rate (a fixed-rate context breaks Firefox);
      // the worklets resample.
      c.ctx = new Context({ latencyHint: 'interactive' });
      const resumed = c.ctx.resume().catch(() => {}); // while the click still counts as a gesture
      vc.contextRate = c.ctx.sampleRate;
      if (!c.ctx.audioWorklet) throw new Error('this browser has no AudioWorklet (is the page on https or localhost?)');
      await c.ctx.audioWorklet.addModule(new URL('resampler.js', base).href);
      await c.ctx.audioWorklet.addModule(new URL('capture-worklet.js', base).href);
      await c.ctx.audioWorklet.addModule(new URL('playback-worklet.js', base).href);
      // A browser without a usable sound output never starts the context: say so.
      const timeout = new Promise((resolve) => setTimeout(resolve, 5000));
      await Promise.race([resumed, timeout]);
      if (c.ctx.state !== 'running') {
        throw new Error('the sound output did not start (no audio device, or the browser blocked it)');
      }
    } catch (error) {
      fail(`audio could not start: ${error && error.message ? error.message : error}`);
      return;
    }
    if (conn !== c) return;
    try {
      c.stream = await navigator.mediaDevices.getUserMedia({
        audio: {
          channelCount: 1,
          echoCancellation: true,
          noiseSuppression: true,
          autoGainControl: true,
        },
      });
    } catch (error) {
      fail(describeMediaError(error));
      return;
    }
    if (conn !== c) { c.stream.getTracks().forEach((t) => t.stop()); return; }

    c.player = new AudioWorkletNode(c.ctx, 'voicechat-playback', {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [c.ctx.destination.channelCount >= 2 ? 2 : 1],
      processorOptions: {
        inputRate: OUTPUT_RATE,
        startSeconds: FRAME_MS / 1000,
        growSeconds: 0.04,
        maxTargetSeconds: 0.3,
        maxLatencySeconds: 0.5,
      },
    });
    c.player.connect(c.ctx.destination);
    c.player.port.onmessage = (event) => onPlayerMessage(c, event.data);

    c.source = c.ctx.createMediaStreamSource(c.stream);
    c.capture = new AudioWorkletNode(c.ctx, 'voicechat-capture', {
      numberOfInputs: 1,
      numberOfOutputs: 0,
      channelCount: 1,
      channelCountMode: 'explicit',
      channelInterpretation: 'speakers',
      processorOptions: { targetRate: inputRate, frameMs: FRAME_MS },
    });
    c.source.connect(c.capture);
    c.capture.port.onmessage = (event) => onCaptureMessage(c, event.data);
    ui.settings.open = false;

    if (ui.transport.value === 'websocket' || transcribing() || !window.RTCPeerConnection) connect(c);
    else connectWebRTC(c);
  }

  // ---------------------------------------------------------------- WebRTC
  function gathered(pc, ms) {
    // The server takes no trickled candidates: the offer goes once gathering is complete.
    return new Promise((resolve) => {
      if (pc.iceGatheringState === 'complete') { resolve(); return; }
      const timer = setTimeout(resolve, ms);
      pc.addEventListener('icegatheringstatechange', () => {
        if (pc.iceGatheringState === 'complete') { clearTimeout(timer); resolve(); }
      });
    });
  }

  function authHeaders(c) {
    return c.secret ? { Authorization: `Bearer ${c.secret}` } : {};
  }

  // The client secret admitted a connection: it admits no other, so the box is emptied.
  function secretSpent(c) {
    if (!c.secret) return;
    vc.secretUsed = true;
    if (ui.secret.value.trim() === c.secret) ui.secret.value = '';
  }

  function refusedText(c, message) {
    return c.secret ? `the server refused the connection: ${message}` : NEEDS_SECRET;
  }

  async function connectWebRTC(c) {
    vc.transport = 'webrtc';
    try {
      const pc = new RTCPeerConnection();
      c.pc = pc;
      pc.addTrack(c.stream.getAudioTracks()[0], c.stream);
      const dc = pc.createDataChannel('oai-events');
      c.dc = dc;
      dc.onmessage = (message) => onMessage(c, message);
      dc.onclose = () => {
        if (conn !== c || c.closing || !c.opened) return;
        teardown(c);
        setState('closed', 'the server ended the session');
      };
      pc.ontrack = (event) => {
        // The browser's own jitter buffer, loss concealment and echo cancellation play it.
        c.audio = new Audio();
        c.audio.autoplay = true;
        c.audio.srcObject = event.streams[0] || new MediaStream([event.track]);
        c.audio.play().catch(() => {});
      };
      let timedOut = null;
      const opened = new Promise((resolve, reject) => {
        dc.addEventListener('open', resolve);
        timedOut = reject;
      });
      opened.catch(() => {}); // awaited below; a timeout before then is no unhandled rejection
      await pc.setLocalDescription(await pc.createOffer());
      await gathered(pc, 2000);
      const url = new URL('/v1/realtime/calls', location.href);
      url.searchParams.set('x-voicechat', '1');  // the server's stats events
      const abort = new AbortController();
      const postTimer = setTimeout(() => abort.abort(), WEBRTC_POST_MS);
      let r;
      try {
        r = await fetch(url.href, {
          method: 'POST',
          body: pc.localDescription.sdp,
          headers: { 'Content-Type': 'application/sdp', ...authHeaders(c) },
          signal: abort.signal,
        });
      } finally {
        clearTimeout(postTimer);
      }
      if (conn !== c) return;
      if (!r.ok) {
        let body = {};
        try { body = await r.json(); } catch (error) { /* not JSON */ }
        const message = (body.error && body.error.message) || `HTTP ${r.status}`;
        if (r.status === 401) {
          fail(refusedText(c, message));
          return;
        }
        if (r.status === 403) {
          fail(`the server refused the connection: ${message}`);
          return;
        }
        if (r.status === 503) {
          teardown(c);
          setState('busy', BUSY_TEXT);
          showError(BUSY_TEXT);
          return;
        }
        throw new Error(message);
      }
      c.callUrl = new URL(r.headers.get('location') || '', location.href).href;
      const answer = await r.text();
      c.connectTimer = setTimeout(() => timedOut(new Error('the connection did not complete')), vc.webrtcConnectMs);
      await pc.setRemoteDescription({ type: 'answer', sdp: answer });
      await opened;
      clearTimeout(c.connectTimer);
      if (conn !== c) return;
      c.opened = true;
      secretSpent(c);
      setState('connected', 'connected, starting the session…');
      c.statsTimer = setInterval(() => pollStats(c), 1000);
    } catch (error) {
      if (conn !== c) return;
      // WebRTC failed or is not offered: the WebSocket carries the conversation instead. The
      // hangup goes first: a call that never connected gives its client secret back.
      vc.webrtcError = error && error.message ? error.message : String(error);
      await closePeer(c, true);
      if (conn !== c) return;
      connect(c);
    }
  }

  async function pollStats(c) {
    if (conn !== c || !c.pc) return;
    const stats = await c.pc.getStats();
    stats.forEach((s) => {
      if (s.type === 'candidate-pair' && s.nominated && s.currentRoundTripTime != null) {
        vc.rttMs = s.currentRoundTripTime * 1000;
      } else if (s.type === 'inbound-rtp' && s.kind === 'audio' && s.totalSamplesReceived != null) {
        const perFrame = (s.clockRate || 48000) * FRAME_MS / 1000;
        // The browser plays what it receives (its jitter buffer conceals what was lost).
        vc.framesReceived = Math.floor(s.totalSamplesReceived / perFrame);
        vc.framesPlayed = vc.framesReceived;
      }
    });
    // Shown at once: what the page reports and what it shows stay the same.
    if (conn === c) updateMetrics();
  }

  // Close the call; with hangup, tell the server (resolves once it answered, at most 2 s).
  function closePeer(c, hangup) {
    clearTimeout(c.connectTimer);
    clearInterval(c.statsTimer);
    let done = Promise.resolve();
    if (hangup && c.callUrl) {
      // The server would hold the call's slot until its own connect timeout: give it back now.
      const told = fetch(`${c.callUrl}/hangup`, { method: 'POST', headers: authHeaders(c) }).catch(() => {});
      done = Promise.race([told, new Promise((resolve) => setTimeout(resolve, 2000))]);
    }
    if (c.dc) { c.dc.onclose = null; c.dc.onmessage = null; try { c.dc.close(); } catch (e) { /* closed */ } }
    if (c.pc) try { c.pc.close(); } catch (e) { /* closed */ }
    if (c.audio) { c.audio.srcObject = null; c.audio = null; }
    c.dc = null;
    c.pc = null;
    c.callUrl = null;
    return done;
  }

  function connect(c) {
    vc.transport = 'websocket';
    const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
    const url = new URL(`${scheme}://${location.host}/v1/realtime`);
    if (modelId) url.searchParams.set('model', modelId);
    url.searchParams.set('x-voicechat', '1');  // the server's stats events (lag, real-time factor)
    // Browsers cannot set headers: the secret travels as a subprotocol, as OpenAI's clients do.
    const protocols = c.secret ? ['realtime', `openai-insecure-api-key.${c.secret}`] : undefined;
    let ws;
    try {
      ws = protocols ? new WebSocket(url.href, protocols) : new WebSocket(url.href);
    } catch (error) {
      fail(`could not open the connection: ${error.message}`);
      return;
    }
    c.ws = ws;
    ws.onopen = () => {
      if (conn !== c) return;
      c.opened = true;
      secretSpent(c);
      setState('connected', 'connected, starting the session…');
    };
    ws.onmessage = (message) => onMessage(c, message);
    ws.onerror = () => {
      // The close event that follows carries the code; report there.
    };
    ws.onclose = (event) => {
      if (conn !== c) return;
      vc.closeCode = event.code;
      if (c.closing) {
        teardown(c);
        setState('closed', 'stopped');
        return;
      }
      let text = describeClose(event.code, event.reason, c.opened);
      if (!c.secret && event.code === 1008) text = NEEDS_SECRET;
      teardown(c);
      if (event.code === 1013) {
        setState('busy', BUSY_TEXT);
        showError(vc.lastError && vc.lastError !== BUSY_TEXT ? `${BUSY_TEXT} (${vc.lastError})` : BUSY_TEXT);
      } else if (event.code === 1000) {
        setState('closed', 'the server ended the session');
        if (event.reason) showError(`the server ended the session: ${event.reason}`);
      } else {
        setState('error', 'disconnected');
        showError(text);
      }
    };
  }

  function sessionUpdate() {
    const rate = vc.inputRate;
    if (transcribing()) {
      const input = { format: { type: 'audio/pcm', rate }, turn_detection: null };
      input.transcription = { model: modelId || 'transcription' };
      return { type: 'session.update', event_id: UPDATE_ID, session: { type: 'transcription', audio: { input } } };
    }
    const session = {
      type: 'realtime',
      output_modalities: ['audio'],
      audio: {
        input: { format: { type: 'audio/pcm', rate } },
        output: { format: { type: 'audio/pcm', rate: OUTPUT_RATE } },
      },
    };
    const instructions = ui.instructions.value.trim();
    if (instructions) session.instructions = instructions;
    return { type: 'session.update', event_id: UPDATE_ID, session };
  }

  function beginAudio(c) {
    if (c.ready) return;
    c.ready = true;
    c.capture.port.postMessage({ type: 'send', value: true });
    setState('connected', 'connected: talk');
  }

  // One server event, from the WebRTC data channel or the WebSocket, for connection c.
  function onMessage(c, message) {
    if (conn !== c) return;
    let event;
    try {
      event = JSON.parse(message.data);
    } catch (error) {
      showError('the server sent a message that is not JSON');
      return;
    }
    onEvent(c, event);
  }

  function onEvent(c, event) {
    const type = event.type || '';
    switch (type) {
      case 'session.created':
        vc.sessionId = event.session && event.session.id;
        if (event.session && event.session.type === 'transcription') vc.mode = 'transcription';
        ui.interrupt.textContent = transcribing() ? 'End item' : 'Interrupt';
        // Instructions and formats go before the first audio: they cannot change later.
        send(sessionUpdate());
        break;
      case 'session.updated':
        beginAudio(c);
        break;
      case 'error': {
        const e = event.error || {};
        const code = e.code || e.type || 'error';
        // An interrupt that crossed the model's own end of turn: nothing left to cancel.
        if (code === 'response_cancel_not_active') break;
        const message = code === 'server_busy' ? BUSY_TEXT : `${e.message || 'the server reported an error'}${e.code ? ` (${e.code})` : ''}`;
        if (e.event_id === UPDATE_ID && !c.ready) {
          // Nothing of a refused session.update applies: audio at our rate would be misread.
          fail(`the server refused the session settings: ${message}`);
          break;
        }
        showError(message);
        if (code === 'server_busy') setState('busy', BUSY_TEXT);
        break;
      }
      case 'conversation.item.added':
      case 'conversation.item.created': {
        const item = event.item || {};
        if (item.role === 'user') userLog.entry(item.id);
        break;
      }
      case 'conversation.item.input_audio_transcription.delta':
        userLog.append(event.item_id || 'user', event.delta || '');
        break;
      case 'conversation.item.input_audio_transcription.completed':
        userLog.set(event.item_id || 'user', event.transcript || '');
        userLog.finish(event.item_id || 'user');
        break;
      case 'response.created': {
        const id = (event.response && event.response.id) || 'response';
        c.responses.set(id, true);
        vc.speaking = true;
        assistantLog.entry(id);
        break;
      }
      case 'response.output_item.added': {
        const item = event.item || {};
        if (item.type === 'function_call') {
          const key = item.call_id || item.id;
          c.functionCalls.set(item.id, key);
          functionLog.set(key, item.arguments || '', `${item.name || 'function'}(`);
        }
        break;
      }
      case 'response.output_audio.delta':
      case 'response.audio.delta': {
        const samples = base64ToFloat32(event.delta || '');
        vc.framesReceived += 1;
        c.receivedTimes.push(performance.now());
        if (c.player) c.player.port.postMessage({ type: 'audio', samples }, [samples.buffer]);
        break;
      }
      case 'output_audio_buffer.started':  // WebRTC: the model's audio starts on the track
        if (!c.firstAudio && c.micStart != null) {
          c.firstAudio = true;
          vc.latencyMs = performance.now() - c.micStart;
        }
        c.receivedTimes.push(performance.now());
        break;
      case 'response.output_audio_transcript.delta':
      case 'response.audio_transcript.delta':
        assistantLog.append(event.response_id || 'response', event.delta || '');
        break;
      case 'response.function_call_arguments.delta': {
        const key = c.functionCalls.get(event.item_id) || event.call_id || event.item_id || 'call';
        functionLog.append(key, event.delta || '', event.name ? `${event.name}(` : 'call(');
        break;
      }
      case 'response.function_call_arguments.done': {
        const key = c.functionCalls.get(event.item_id) || event.call_id || event.item_id || 'call';
        functionLog.set(key, event.arguments || '', `${event.name || 'function'}(`);
        functionLog.finish(key);
        vc.toolCalls.push({ call_id: event.call_id, name: event.name, arguments: event.arguments });
        break;
      }
      case 'response.done': {
        const response = event.response || {};
        const id = response.id || 'response';
        c.responses.delete(id);
        vc.speaking = c.responses.size > 0;
        assistantLog.finish(id, response.status === 'cancelled' ? 'cancelled' : null);
        // The model's own end of turn: play out what is queued, then start over empty.
        // A cancelled response was emptied at once when the cancel was sent.
        if (c.player) c.player.port.postMessage({ type: response.status === 'cancelled' ? 'flush' : 'drain' });
        break;
      }
      default:
        if (/stats|metrics|lag/.test(type) || event.lag_ms != null || event.stats) readStats(event);
        break;
    }
  }

  function onCaptureMessage(c, message) {
    if (conn !== c) return;
    // One timeline column per captured 80 ms frame, sent or not.
    pendingInput = message.rms;
    tickTimeline();
    if (message.type !== 'frame') return;
    if (c.pc) {  // WebRTC: the microphone's track carries the audio
      if (c.micStart == null) c.micStart = performance.now();
      vc.framesSent += 1;
      return;
    }
    if (send({ type: 'input_audio_buffer.append', audio: int16ToBase64(message.pcm) })) {
      if (c.micStart == null) c.micStart = performance.now();
      vc.framesSent += 1;
    }
  }

  function onPlayerMessage(c, message) {
    if (conn !== c) return;
    if (message.type === 'started') {
      if (!c.firstAudio && c.micStart != null) {
        c.firstAudio = true;
        // Up to the worklet starting to play; plus the context's fixed processing latency.
        // (Not outputLatency: reading it in Firefox 153 can hang the page.)
        vc.latencyMs = performance.now() - c.micStart + (c.ctx.baseLatency || 0) * 1000;
      }
    } else if (message.type === 'stats') {
      c.playerStats = message;
      vc.framesPlayed = message.played;
      vc.framesDropped = message.dropped;
      vc.underruns = message.underruns;
      pendingOutput = Math.max(pendingOutput, message.rms);
    }
  }

  function interrupt() {
    if (!conn) return;
    if (transcribing()) {
      // End the item: its completed transcript comes back; the next audio opens a new one.
      if (vc.framesSent > 0) send({ type: 'input_audio_buffer.commit' });
      return;
    }
    // Only an open response can be cancelled; the player is emptied either way.
    if (conn.responses.size > 0) send({ type: 'response.cancel' });
    if (conn.player) conn.player.port.postMessage({ type: 'flush' });
    if (conn.pc) send({ type: 'output_audio_buffer.clear' });
  }

  function teardown(c) {
    if (c.pc) {
      c.closing = true;
      closePeer(c, false);
    }
    if (c.capture) {
      c.capture.port.postMessage({ type: 'stop' });
      c.capture.port.onmessage = null;
      try { c.capture.disconnect(); } catch (e) { /* already disconnected */ }
    }
    if (c.source) try { c.source.disconnect(); } catch (e) { /* already disconnected */ }
    if (c.stream) c.stream.getTracks().forEach((t) => t.stop());
    if (c.player) {
      c.player.port.onmessage = null;
      try { c.player.disconnect(); } catch (e) { /* already disconnected */ }
    }
    if (c.ctx && c.ctx.state !== 'closed') c.ctx.close().catch(() => {});
    if (c.ws && c.ws.readyState <= WebSocket.OPEN) {
      c.closing = true;
      try { c.ws.close(1000, 'client stopped'); } catch (e) { /* already closing */ }
    }
    vc.speaking = false;
    if (conn === c) conn = null;
    updateMetrics();
    setRunning(false);
  }

  function fail(message) {
    const c = conn;
    showError(message);
    if (c) teardown(c);
    setState('error', 'not connected');
  }

  function stop() {
    const c = conn;
    if (!c) return;
    c.closing = true;
    teardown(c);
    setState('closed', 'stopped');
  }

  // ---------------------------------------------------------------- wiring
  ui.start.addEventListener('click', () => {
    start().catch((error) => fail(`could not start: ${error && error.message ? error.message : error}`));
  });
  ui.stop.addEventListener('click', stop);
  $('settings-form').addEventListener('submit', (event) => event.preventDefault());
  ui.interrupt.addEventListener('click', interrupt);
  window.addEventListener('pagehide', stop);
  window.addEventListener('error', (event) => showError(`page error: ${event.message}`));

  // A client secret in the address's fragment (#secret=ek_...; a fragment is never sent to a
  // server): into the box, and out of the address bar (not kept in history or bookmarks).
  function secretFromAddress() {
    const fragment = new URLSearchParams(location.hash.replace(/^#/, ''));
    if (!fragment.get('secret')) return;
    ui.secret.value = fragment.get('secret');
    fragment.delete('secret');
    const rest = fragment.toString();
    history.replaceState(null, '', `${location.pathname}${location.search}${rest ? `#${rest}` : ''}`);
  }
  secretFromAddress();
  window.addEventListener('hashchange', secretFromAddress);

  const saved = (() => { try { return localStorage.getItem('voicechat.instructions'); } catch (e) { return null; } })();
  if (saved) ui.instructions.value = saved;
  ui.instructions.addEventListener('change', () => {
    try { localStorage.setItem('voicechat.instructions', ui.instructions.value); } catch (e) { /* private mode */ }
  });

  // The model's name, from this server's /health (same origin, no key needed; nothing is
  // fetched from elsewhere).
  fetch('/health').then((r) => (r.ok ? r.json() : null)).then((body) => {
    if (body && typeof body.model === 'string') {
      modelId = body.model;
      ui.model.textContent = body.model;
    }
  }).catch(() => {});

  updateMetrics();
  requestAnimationFrame(animate);
})();
