// @openai/agents-realtime (WebSocket transport) on its defaults, pointed at `serve` by URL and
// key alone. Driven by tests/serve/test_js_clients.py, which forces a get_weather call into the live
// session once audio flows. Prints one JSON line: what the client saw.
import { readFileSync } from 'node:fs';
import { RealtimeAgent, RealtimeSession, tool } from '@openai/agents-realtime';
import { z } from 'zod';
import { sleep, until } from './wait.mjs';

const url = process.env.VOICECHAT_URL; // ws://127.0.0.1:PORT/v1/realtime
const apiKey = process.env.VOICECHAT_KEY;
// 24 kHz PCM16 speech starting at its first sample: the user barges in with it (else interrupt())
const speech = process.env.VOICECHAT_SPEECH ? readFileSync(process.env.VOICECHAT_SPEECH) : null;
const CHUNK = 1920; // bytes: 40 ms of 24 kHz PCM16, as a microphone sends it
const INSTRUCTIONS = 'You are a weather assistant. Be brief.';
const seen = { updated: [], errors: [], audioDeltas: 0, toolCalls: [], toolOutputs: 0,
  cancelled: false, truncated: false, speechStarted: 0, types: {} };

const getWeather = tool({
  name: 'get_weather',
  description: 'Current weather for a city.',
  parameters: z.object({ city: z.string() }),
  execute: async ({ city }) => {
    seen.toolCalls.push(city);
    return JSON.stringify({ city, temp_c: 21 });
  },
});
const agent = new RealtimeAgent({ name: 'Weather', instructions: INSTRUCTIONS, tools: [getWeather] });
const session = new RealtimeSession(agent, { transport: 'websocket' });

session.transport.on('*', (e) => {
  seen.types[e.type] = (seen.types[e.type] || 0) + 1;
  if (e.type === 'session.updated') seen.updated.push(e.session);
  else if (e.type === 'error') seen.errors.push(e.error);
  else if (e.type === 'response.output_audio.delta') seen.audioDeltas += 1;
  else if (e.type === 'conversation.item.done' && e.item.type === 'function_call_output') {
    seen.toolOutputs += 1;
  } else if (e.type === 'response.done' && e.response.status === 'cancelled') seen.cancelled = true;
  else if (e.type === 'conversation.item.truncated') seen.truncated = true;
  else if (e.type === 'input_audio_buffer.speech_started') seen.speechStarted += 1;
});
let speechSent = null; // bytes of speech sent so far, once the barge-in began
let bargeAt = null;
session.on('audio_interrupted', () => {
  if (speechSent !== null && !seen.bargeIn) {
    seen.bargeIn = { speechMsSent: speechSent / 48, msAfterOnset: Date.now() - bargeAt };
  }
});
session.on('error', (e) => seen.errors.push({ session: JSON.stringify(e.error?.error ?? e.error ?? String(e)).slice(0, 300) }));

let exitCode = 0;
let feeder;
try {
  await session.connect({ apiKey, url });
  const has = (s) => s.instructions === INSTRUCTIONS && (s.tools || []).some((t) => t.name === 'get_weather');
  await until('session.updated with the instructions and tools', () => seen.updated.some(has), 20000);
  // silence at real time, then the speech once the barge-in begins
  feeder = setInterval(() => {
    if (speechSent === null || speechSent >= speech.length) {
      session.sendAudio(new ArrayBuffer(CHUNK));
      return;
    }
    const part = speech.subarray(speechSent, speechSent + CHUNK);
    if (speechSent === 0) bargeAt = Date.now();
    session.sendAudio(part.buffer.slice(part.byteOffset, part.byteOffset + part.length));
    speechSent += part.length;
  }, 40);
  process.stdout.write(JSON.stringify({ ready: true }) + '\n');
  await until("the tool call and its output", () => seen.toolCalls.length && seen.toolOutputs, 90000);
  const before = seen.audioDeltas;
  await until('audio after the tool call', () => seen.audioDeltas > before, 30000);
  await until('a response to interrupt', () => seen.types['response.created'] >
    (seen.types['response.done'] || 0), 30000);
  if (speech) {
    speechSent = 0; // the user speaks: the SDK hears speech_started and interrupts by itself
    await until('the barge-in', () => seen.bargeIn, 20000);
  } else {
    session.interrupt();
  }
  await until('the interrupt answered', () => seen.cancelled || seen.truncated, 20000);
  await sleep(1500); // errors that the interrupt's follow-ups (retrieve, ...) bring
} catch (e) {
  seen.failure = String(e.message ?? e);
  exitCode = 1;
} finally {
  clearInterval(feeder);
  session.close();
}
process.stdout.write(JSON.stringify({ result: seen }) + '\n');
process.exit(exitCode);
