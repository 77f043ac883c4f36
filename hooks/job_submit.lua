--[[
slurm-resilience job_submit.lua: keep each tightly coupled job under one InfiniBand leaf,
or within one NVLink block (GB200 NVL72, TopologyPlugin=topology/block).

Install: beside slurm.conf (JobSubmitPlugins=lua), with the data file that
`slurm-resilience topology generate` writes (slurm-resilience-topology.lua) in
the same directory. The data is loaded once, when slurmctld loads (or reloads,
after this file's mtime changes) the script: a submission does no I/O and
spawns nothing, since job_submit runs inside slurmctld under its locks.

For a job with min_nodes > 1 that did not pass --switches itself:
  * mode "tree" (TopologyPlugin=topology/tree): fits in the largest leaf ->
    req_switch = 1, wait4switch from the data; larger -> the fewest leaves
    that can hold it (large_jobs = "min-leaves") or nothing ("leave").
  * mode "feature": fits in some leaf -> the matching-OR leaf constraint
    [leaf_a|leaf_b|...] (leaves big enough, largest first) ANDed with the
    user's own constraint. A constraint that already has brackets (or node
    counts) is left alone: Slurm rejects a second bracketed set.
  * NVLink blocks (data generated --from-nvlink-domains, unit "block"): the
    blocks are the leaves of mode "tree"; topology/block reads req_switch = 1
    as one block. A job larger than any block is left to Slurm's own block
    placement and to the user's --segment (Slurm 24.05+).
Opt-outs: a partition in opt_out_partitions; the variable named opt_out_env
(default SLURM_RESILIENCE_LEAF_PIN) set to off/0/no/false in the batch job's
environment (job_desc.environment exists for batch jobs only) or in the SPANK
job environment (job_desc.spank_job_env, which a SPANK option such as
--leaf-pin=off fills through spank_job_control_setenv, for srun/salloc too);
or "leaf-pin=off" in the job's --comment. Jobs that name their nodes (-w) are
left alone.
Each decision is logged in one slurm.log_info line. Whatever happens, the
job is accepted: a bug here must never block a submission.
Written for Slurm's Lua 5.1 (also runs on 5.2+).
--]]

local DATA_FILE = "slurm-resilience-topology.lua"
local DEFAULT_DIR = "/etc/slurm"
local TAG = "slurm-resilience leaf-pin"
local NO_VAL = 4294967294 -- 0xfffffffe: Slurm's "not set" for 32-bit fields

local OFF = { off = true, ["0"] = true, no = true, ["false"] = true }

-- The directory of this script, from the chunk name slurmctld loaded it with.
local function script_dir()
	local info = debug and debug.getinfo and debug.getinfo(1, "S")
	local src = info and info.source or ""
	if src:sub(1, 1) == "@" then
		return src:sub(2):match("^(.*)/[^/]*$") or "."
	end
	return DEFAULT_DIR
end

-- Load the data table in an empty environment: the data file can define values only.
local function load_data(path)
	local chunk, err
	if setfenv then
		chunk, err = loadfile(path)
		if chunk then
			setfenv(chunk, {})
		end
	else
		chunk, err = loadfile(path, "t", {})
	end
	if not chunk then
		return nil, err
	end
	local ok, data = pcall(chunk)
	if not ok then
		return nil, data
	end
	if type(data) ~= "table" or data.format ~= 1 or type(data.leaves) ~= "table" then
		return nil, path .. ": not a slurm-resilience topology table of format 1"
	end
	return data
end

-- Sizes (largest first), running totals, and the matching-OR constraint of the k largest.
local function prepare(leaves, max_feature)
	local t = { sizes = {}, cum = {}, constraint = {} }
	local names, total = {}, 0
	for i, leaf in ipairs(leaves) do
		t.sizes[i] = leaf.nodes
		total = total + leaf.nodes
		t.cum[i] = total
		if i <= max_feature then
			names[i] = leaf.feature
			t.constraint[i] = "[" .. table.concat(names, "|") .. "]"
		end
	end
	t.count = #leaves
	return t
end

local DATA, LOAD_ERROR = load_data(script_dir() .. "/" .. DATA_FILE)
local TABLES = {}
local UNIT = "leaf" -- what a leaf is: an InfiniBand leaf, or an NVLink block (GB200 NVL72)
if DATA then
	local max_feature = DATA.max_feature_leaves or 64
	TABLES[""] = prepare(DATA.leaves, max_feature)
	for name, leaves in pairs(DATA.partitions or {}) do
		TABLES[name] = prepare(leaves, max_feature)
	end
	UNIT = DATA.unit or "leaf"
	slurm.log_info("%s: loaded %d %s (largest %d nodes), mode %s", TAG, TABLES[""].count,
		UNIT == "block" and "NVLink blocks" or "leaves",
		TABLES[""].sizes[1] or 0, tostring(DATA.mode))
else
	slurm.log_error("%s: couldn't load %s: %s; jobs are not pinned", TAG, DATA_FILE,
		tostring(LOAD_ERROR))
end

local function unset(value)
	return value == nil or value == NO_VAL or value >= NO_VAL
end

-- Number of leaves holding at least n nodes (sizes are sorted, largest first).
local function leaves_fitting(t, n)
	local lo, hi = 1, t.count
	if hi == 0 or t.sizes[1] < n then
		return 0
	end
	while lo < hi do
		local mid = math.floor((lo + hi + 1) / 2)
		if t.sizes[mid] >= n then
			lo = mid
		else
			hi = mid - 1
		end
	end
	return lo
end

local function opted_out(job_desc, partition)
	for part in string.gmatch(partition or "", "[^,]+") do
		if DATA.opt_out_partitions and DATA.opt_out_partitions[part] then
			return "partition " .. part .. " opted out"
		end
	end
	local var = DATA.opt_out_env or "SLURM_RESILIENCE_LEAF_PIN"
	local comment = job_desc.comment
	if comment and string.find(comment, "leaf-pin=off", 1, true) then
		return "comment leaf-pin=off"
	end
	local spank = job_desc.spank_job_env
	if type(spank) == "table" then
		for _, entry in pairs(spank) do
			local name, value = string.match(tostring(entry), "^([^=]+)=(.*)$")
			if (name == var or name == "SPANK_" .. var) and OFF[string.lower(value)] then
				return "SPANK " .. name .. "=" .. value
			end
		end
	end
	-- environment exists for batch jobs only; reading it for others makes Slurm log noise.
	if job_desc.script ~= nil then
		local env = job_desc.environment
		local value = env and env[var]
		if value and OFF[string.lower(value)] then
			return "environment " .. var .. "=" .. value
		end
	end
	return nil
end

local function pin_feature(job_desc, t, fits)
	local own = job_desc.features
	local k = math.min(fits, #t.constraint)
	local bracket = t.constraint[k]
	if own == nil or own == "" then
		job_desc.features = bracket
	elseif string.find(own, "[", 1, true) or string.find(own, "*", 1, true) then
		return "left alone: constraint " .. own .. " already has brackets or counts"
	elseif string.find(own, "|", 1, true) then
		job_desc.features = "(" .. own .. ")&" .. bracket
	else
		job_desc.features = own .. "&" .. bracket
	end
	return "constraint " .. job_desc.features .. " (" .. k .. " leaves)"
end

local function decide(job_desc)
	if DATA == nil then
		return "left alone: no topology data"
	end
	if DATA.mode == "off" then
		return "left alone: mode off"
	end
	local n = job_desc.min_nodes
	if unset(n) or n <= 1 then
		return nil -- single-node (or node count not given): nothing to do, nothing to log
	end
	if not unset(job_desc.req_switch) then
		return "left alone: job asked for --switches itself"
	end
	if job_desc.req_nodes ~= nil and job_desc.req_nodes ~= "" then
		return "left alone: job names its nodes"
	end
	local partition = job_desc.partition
	if partition == nil or partition == "" then
		partition = DATA.default_partition
	end
	local why = opted_out(job_desc, partition)
	if why then
		return "left alone: " .. why
	end
	local t = TABLES[partition or ""] or TABLES[""]
	local fits = leaves_fitting(t, n)
	if DATA.mode == "feature" then
		if fits == 0 then
			return "left alone: larger than any " .. UNIT .. " (" .. (t.sizes[1] or 0) .. " nodes)"
		end
		return pin_feature(job_desc, t, fits)
	end
	local want = 1
	if fits == 0 then
		if DATA.large_jobs ~= "min-leaves" then
			local more = ""
			if UNIT == "block" then
				more = ": Slurm's block placement (and the job's --segment) splits it"
			end
			return "left alone: larger than any " .. UNIT .. " (" .. (t.sizes[1] or 0)
				.. " nodes)" .. more
		end
		want = nil
		for i = 1, t.count do
			if t.cum[i] >= n then
				want = i
				break
			end
		end
		if want == nil then
			return "left alone: larger than the fabric"
		end
	end
	job_desc.req_switch = want
	job_desc.wait4switch = DATA.wait4switch
	return "switches=" .. want .. "@" .. DATA.wait4switch .. "s"
end

-- What a user typed (job name, partition, comment, constraint, environment) reaches
-- slurmctld.log only through esc(): one printable ASCII line, bounded, with quotes,
-- backslashes and control or non-ASCII bytes as \xHH, so it can't split or forge a line.
local MAX_LOGGED = 200

local function esc(value)
	local s = tostring(value)
	local more = ""
	if #s > MAX_LOGGED then
		more = "...[" .. (#s - MAX_LOGGED) .. " more]"
		s = string.sub(s, 1, MAX_LOGGED)
	end
	s = string.gsub(s, '[%c"\\\128-\255]', function(c)
		return string.format("\\x%02x", string.byte(c))
	end)
	return s .. more
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	local ok, result = pcall(decide, job_desc)
	if not ok then
		slurm.log_error("%s: internal error, job accepted unchanged: %s", TAG, esc(result))
	elseif result then
		slurm.log_info('%s: job "%s" uid=%s nodes=%s partition="%s": %s', TAG,
			esc(job_desc.name), esc(submit_uid), esc(job_desc.min_nodes),
			esc(job_desc.partition), esc(result))
	end
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	return slurm.SUCCESS
end

return slurm.SUCCESS
