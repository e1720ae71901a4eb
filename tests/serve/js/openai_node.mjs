// The `openai` npm package's `openai/realtime/ws` on its defaults, pointed at `serve` by base URL
// and key alone. It always connects with wss:, so the server runs with --ssl-*; Node trusts the
// test's certificate through NODE_EXTRA_CA_CERTS. Driven by tests/serve/test_js_clients.py, which
// forces a get_weather call into the live session once audio flows. Prints one JSON line.
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';
import { sleep, until } from './wait.mjs';

const INSTRUCTIONS = 'You are a weather assistant. Be brief.';
const WEATHER = {
  type: 'function',
  name: 'get_weather',
  description: 'Current weather for a city.',
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
};
const seen = { updated: [], errors: [], audioDeltas: 0, toolCalls: [], toolOutputs: 0,
  cancelled: false, opened: false, url: null, types: {} };

const client = new OpenAI({ apiKey: process.env.VOICECHAT_KEY, baseURL: process.env.VOICECHAT_BASE_URL });
const rt = new OpenAIRealtimeWS({ model: 'nemotron-voicechat' }, client);
seen.url = rt.url.href;
let open = 0; // responses created less responses done
rt.socket.on('open', () => { seen.opened = true; });
rt.on('error', (e) => seen.errors.push({ message: String(e.message), code: e.error?.code ?? null }));
rt.on('event', (e) => {
  seen.types[e.type] = (seen.types[e.type] || 0) + 1;
  if (e.type === 'session.updated') seen.updated.push(e.session);
  else if (e.type === 'response.output_audio.delta') seen.audioDeltas += 1;
  else if (e.type === 'response.created') open += 1;
  else if (e.type === 'response.done') {
    open -= 1;
    if (e.response.status === 'cancelled') seen.cancelled = true;
  } else if (e.type === 'conversation.item.done' && e.item.type === 'function_call_output') {
    seen.toolOutputs += 1;
  }
});
rt.on('response.function_call_arguments.done', (e) => {
  // what an application does with a call: run the tool, send its output, ask for a reply
  const { city } = JSON.parse(e.arguments);
  seen.toolCalls.push(city);
  rt.send({
    type: 'conversation.item.create',
    item: { type: 'function_call_output', call_id: e.call_id, output: JSON.stringify({ city, temp_c: 21 }) },
  });
  rt.send({ type: 'response.create' });
});

let exitCode = 0;
let feeder;
try {
  await until('the wss: connection', () => seen.opened, 20000);
  rt.send({ type: 'session.update', session: { type: 'realtime', instructions: INSTRUCTIONS, tools: [WEATHER] } });
  const has = (s) => s.instructions === INSTRUCTIONS && (s.tools || []).some((t) => t.name === 'get_weather');
  await until('session.updated with the instructions and tools', () => seen.updated.some(has), 20000);
  const silence = Buffer.alloc(3840).toString('base64'); // 80 ms of 24 kHz PCM16
  feeder = setInterval(() => rt.send({ type: 'input_audio_buffer.append', audio: silence }), 80);
  process.stdout.write(JSON.stringify({ ready: true }) + '\n');
  await until('the tool call and its output', () => seen.toolCalls.length && seen.toolOutputs, 90000);
  const before = seen.audioDeltas;
  await until('audio after the tool call', () => seen.audioDeltas > before, 30000);
  await until('a response to interrupt', () => open > 0, 30000);
  rt.send({ type: 'response.cancel' });
  await until('the interrupt answered', () => seen.cancelled, 20000);
  await sleep(1000);
} catch (e) {
  seen.failure = String(e.message ?? e);
  exitCode = 1;
} finally {
  clearInterval(feeder);
  rt.close();
}
process.stdout.write(JSON.stringify({ result: seen }) + '\n');
process.exit(exitCode);
