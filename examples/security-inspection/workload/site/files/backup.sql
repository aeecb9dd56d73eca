-- a stand-in for a file that should never be listed or served
CREATE TABLE users (name TEXT, password_hash TEXT);
