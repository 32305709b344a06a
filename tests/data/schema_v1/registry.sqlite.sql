-- flywheel's registry store at schema version 1 (sqlite), as that release created it
CREATE TABLE flywheel_meta (
	"key" VARCHAR(100) NOT NULL, 
	value VARCHAR(200) NOT NULL, 
	PRIMARY KEY ("key")
);
CREATE TABLE registry_versions (
	seq INTEGER NOT NULL, 
	id VARCHAR(64) NOT NULL, 
	"key" VARCHAR(255), 
	created_at DATETIME NOT NULL, 
	path TEXT NOT NULL, 
	source TEXT NOT NULL, 
	storage VARCHAR(16) NOT NULL, 
	parent VARCHAR(64), 
	cycle VARCHAR(200), 
	status VARCHAR(16) NOT NULL, 
	reasons JSON NOT NULL, 
	data_counts JSON NOT NULL, 
	config JSON NOT NULL, 
	eval_scores JSON NOT NULL, 
	cost JSON NOT NULL, 
	files JSON NOT NULL, 
	notes TEXT NOT NULL, 
	PRIMARY KEY (seq), 
	UNIQUE (id), 
	UNIQUE ("key"), 
	FOREIGN KEY(parent) REFERENCES registry_versions (id)
);
CREATE INDEX ix_registry_versions_cycle ON registry_versions (cycle);
CREATE INDEX ix_registry_versions_parent ON registry_versions (parent);
CREATE INDEX ix_registry_versions_status ON registry_versions (status);
CREATE UNIQUE INDEX registry_one_production ON registry_versions (status) WHERE status = 'production';
CREATE TABLE registry_state (
	id INTEGER NOT NULL, 
	production VARCHAR(64), 
	generation INTEGER NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(production) REFERENCES registry_versions (id)
);
CREATE TABLE registry_history (
	seq INTEGER NOT NULL, 
	at DATETIME NOT NULL, 
	action VARCHAR(16) NOT NULL, 
	version VARCHAR(64) NOT NULL, 
	previous VARCHAR(64), 
	reason TEXT NOT NULL, 
	generation INTEGER NOT NULL, 
	PRIMARY KEY (seq), 
	FOREIGN KEY(version) REFERENCES registry_versions (id), 
	FOREIGN KEY(previous) REFERENCES registry_versions (id)
);
CREATE INDEX ix_registry_history_version ON registry_history (version);
CREATE TABLE registry_pruned (
	version VARCHAR(64) NOT NULL, 
	at DATETIME NOT NULL, 
	reason TEXT NOT NULL, 
	bytes INTEGER NOT NULL, 
	PRIMARY KEY (version), 
	FOREIGN KEY(version) REFERENCES registry_versions (id)
);
INSERT INTO flywheel_meta (key, value) VALUES ('registry.schema_version', '1');
