// Playback: a ring buffer at the AudioContext's rate fed with the server's PCM (resampled
// here from the session's output rate, one stream, so packet joins have no seam), behind a
// small jitter buffer: playback starts once `target` samples are queued (about one frame),
// an underrun raises the target, audio queued longer than `maxLatency` is dropped. Starts
// and stops are 5 ms ramps, so neither an underrun nor a flush clicks.
// Messages in: {type: 'audio', samples: Float32Array}, {type: 'flush'} (cancel: empty now),
// {type: 'drain'} (end of turn: play what is queued, then start over empty).
// Messages out: {type: 'stats', ...} about every 50 ms, {type: 'started'} when sound starts.
class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions;
    this.resampler = new StreamResampler(o.inputRate, sampleRate);
    this.capacity = Math.ceil(sampleRate * 4);
    this.ring = new Float32Array(this.capacity);
    this.read = 0; // absolute sample counters; ring index = counter % capacity
    this.write = 0;
    this.startTarget = Math.round(sampleRate * o.startSeconds);
    this.target = this.startTarget;
    this.growBy = Math.round(sampleRate * o.growSeconds);
    this.maxTarget = Math.round(sampleRate * o.maxTargetSeconds);
    this.maxLatency = Math.round(sampleRate * o.maxLatencySeconds);
    this.ramp = 1 / Math.max(1, Math.round(sampleRate * 0.005));
    this.decay = Math.exp(Math.log(0.01) / Math.max(1, Math.round(sampleRate * 0.005)));
    this.playing = false;
    this.draining = false;
    this.flushing = false;
    this.gain = 0;
    this.last = 0;
    this.chunkEnds = [];
    this.received = 0;
    this.played = 0;
    this.dropped = 0;
    this.underruns = 0;
    this.sumSquares = 0;
    this.counted = 0;
    this.blocks = 0;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(message) {
    if (message.type === 'audio') {
      const samples = this.resampler.process(message.samples);
      for (let i = 0; i < samples.length; i++) this.ring[(this.write + i) % this.capacity] = samples[i];
      this.write += samples.length;
      this.chunkEnds.push(this.write);
      this.received += 1;
      this.draining = false;
      if (this.write - this.read > this.capacity) this.skipTo(this.write - this.target);
    } else if (message.type === 'flush') {
      if (this.playing) this.flushing = true;
      else this.clear();
    } else if (message.type === 'drain') {
      this.draining = this.write > this.read;
      if (!this.draining) this.clear();
    }
  }

  countPlayed() {
    while (this.chunkEnds.length && this.chunkEnds[0] <= this.read) {
      this.chunkEnds.shift();
      this.played += 1;
    }
  }

  skipTo(position) {
    this.countPlayed();
    if (position <= this.read) return;
    this.read = position;
    while (this.chunkEnds.length && this.chunkEnds[0] <= this.read) {
      this.chunkEnds.shift();
      this.dropped += 1;
    }
    this.gain = 0; // fade back in from the new position
  }

  clear() {
    this.skipTo(this.write);
    this.playing = false;
    this.flushing = false;
    this.draining = false;
    this.target = this.startTarget;
    this.resampler.reset();
  }

  process(inputs, outputs) {
    const output = outputs[0];
    const out = output[0];
    const n = out.length;
    if (!this.playing && !this.flushing) {
      const queued = this.write - this.read;
      if (queued >= this.target || (this.draining && queued > 0)) {
        this.playing = true;
        this.port.postMessage({ type: 'started', time: currentTime });
      }
    }
    if (this.playing && this.write - this.read > this.maxLatency) {
      this.skipTo(this.write - this.target);
    }
    for (let i = 0; i < n; i++) {
      let s;
      if (this.playing && this.read < this.write) {
        if (this.flushing) this.gain -= this.ramp;
        else if (this.gain < 1) this.gain = Math.min(1, this.gain + this.ramp);
        s = this.ring[this.read % this.capacity] * Math.max(0, this.gain);
        this.read += 1;
        this.last = s;
        if (this.flushing && this.gain <= 0) {
          this.clear();
        }
      } else {
        if (this.playing) {
          // Ran dry: at the end of a turn start over; mid-turn it is an underrun.
          if (this.draining) this.clear();
          else {
            this.underruns += 1;
            this.target = Math.min(this.maxTarget, this.target + this.growBy);
          }
          this.playing = false;
        }
        this.gain = 0;
        this.last *= this.decay;
        s = this.last;
      }
      out[i] = s;
      this.sumSquares += s * s;
    }
    this.counted += n;
    for (let c = 1; c < output.length; c++) output[c].set(out);
    this.countPlayed();
    if (++this.blocks % 16 === 0) {
      this.port.postMessage({
        type: 'stats',
        received: this.received,
        played: this.played,
        dropped: this.dropped,
        underruns: this.underruns,
        queuedSeconds: (this.write - this.read) / sampleRate,
        targetSeconds: this.target / sampleRate,
        rms: Math.sqrt(this.sumSquares / this.counted),
        time: currentTime,
      });
      this.sumSquares = 0;
      this.counted = 0;
    }
    return true;
  }
}

registerProcessor('voicechat-playback', PlaybackProcessor);
