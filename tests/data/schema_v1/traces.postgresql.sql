-- flywheel's traces store at schema version 1 (postgresql), as that release created it
CREATE TABLE flywheel_meta (
	key VARCHAR(100) NOT NULL, 
	value VARCHAR(200) NOT NULL, 
	PRIMARY KEY (key)
);
CREATE TABLE traces (
	seq SERIAL NOT NULL, 
	id VARCHAR(128) NOT NULL, 
	idempotency_key VARCHAR(255) NOT NULL, 
	content_hash VARCHAR(64) NOT NULL, 
	created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	source VARCHAR(200) NOT NULL, 
	model VARCHAR(200), 
	model_version VARCHAR(200), 
	messages JSONB NOT NULL, 
	tools JSONB, 
	response JSONB, 
	usage JSONB, 
	prompt_tokens INTEGER, 
	completion_tokens INTEGER, 
	latency_ms FLOAT, 
	metadata JSONB, 
	PRIMARY KEY (seq), 
	UNIQUE (id), 
	UNIQUE (idempotency_key)
);
CREATE INDEX ix_traces_created_at ON traces (created_at);
CREATE INDEX ix_traces_source ON traces (source);
CREATE TABLE trace_feedback (
	seq SERIAL NOT NULL, 
	id VARCHAR(128) NOT NULL, 
	trace_id VARCHAR(128) NOT NULL, 
	idempotency_key VARCHAR(255), 
	content_hash VARCHAR(64) NOT NULL, 
	created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL, 
	score FLOAT, 
	label VARCHAR(200), 
	correction JSONB, 
	text TEXT, 
	verifier_env VARCHAR(200), 
	verifier_task JSONB, 
	PRIMARY KEY (seq), 
	UNIQUE (id), 
	FOREIGN KEY(trace_id) REFERENCES traces (id) ON DELETE CASCADE, 
	UNIQUE (idempotency_key)
);
CREATE INDEX ix_trace_feedback_label ON trace_feedback (label);
CREATE INDEX ix_trace_feedback_trace_id ON trace_feedback (trace_id);
CREATE INDEX ix_trace_feedback_verifier_env ON trace_feedback (verifier_env);
INSERT INTO flywheel_meta (key, value) VALUES ('traces.schema_version', '1');
