-- wrk script for load.py: POST /predict with one row of 64 features a request, from
-- 256 bodies drawn once with a fixed seed, and a machine-readable summary at the end.
--   wrk -t1 -c32 -d5s --latency -s predict.lua http://127.0.0.1:8000/predict

local bodies = {}
local next_body = 0

function init(args)
  math.randomseed(0)
  local headers = { ["Content-Type"] = "application/json" }
  for i = 1, 256 do
    local features = {}
    for j = 1, 64 do
      features[j] = string.format("%.4f", math.random() * 2 - 1)
    end
    local body = '{"features": [' .. table.concat(features, ", ") .. ']}'
    bodies[i] = wrk.format("POST", nil, headers, body)
  end
end

function request()
  next_body = next_body % #bodies + 1
  return bodies[next_body]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'load.py: {"requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, '
      .. '"p99_us": %d, "max_us": %d, "errors": {"connect": %d, "read": %d, '
      .. '"write": %d, "status": %d, "timeout": %d}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
