// Package pgtest gives each test its own migrated PostgreSQL schema on the
// real server, so integration tests run in parallel without sharing state.
//
// The server comes from FIFOBOX_TEST_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable), or from a
// testcontainers PostgreSQL with FIFOBOX_TESTCONTAINERS=1 where Docker
// exists. If it does not answer, the test fails (CI starts PostgreSQL; see
// .ci/run).
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/containers"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/redact"
)

// DefaultURL is used when FIFOBOX_TEST_DATABASE_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

var (
	urlOnce sync.Once
	baseURL string
)

// URL returns the base connection string for tests: FIFOBOX_TEST_DATABASE_URL,
// else a PostgreSQL container when FIFOBOX_TESTCONTAINERS=1 (see
// internal/containers), else DefaultURL.
func URL() string {
	urlOnce.Do(func() {
		switch {
		case os.Getenv("FIFOBOX_TEST_DATABASE_URL") != "":
			baseURL = os.Getenv("FIFOBOX_TEST_DATABASE_URL")
		case containers.Enabled():
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			u, err := containers.Start(ctx, containers.Postgres)
			if err != nil {
				fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
				os.Exit(1)
			}
			fmt.Fprintf(os.Stderr, "pgtest: using a PostgreSQL container (testcontainers) at %s\n", u)
			baseURL = u
		default:
			baseURL = DefaultURL
		}
	})
	return baseURL
}

// DB is one test's schema.
type DB struct {
	// Pool is connected with search_path set to Schema.
	Pool *pgxpool.Pool
	// Schema is the fresh schema's name.
	Schema string
	// URL connects to the same schema (search_path in the options), for subprocesses.
	URL string
}

// New creates a fresh schema, applies the migrations to it and drops it when
// the test ends.
func New(tb testing.TB) *DB {
	tb.Helper()
	return newSchema(tb, URL(), true)
}

// NewEmpty creates a fresh schema without migrating it.
func NewEmpty(tb testing.TB) *DB {
	tb.Helper()
	return newSchema(tb, URL(), false)
}

func newSchema(tb testing.TB, base string, migrate bool) *DB {
	tb.Helper()
	db := newEmpty(tb, base)
	if !migrate {
		return db
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := migrations.Up(ctx, db.Pool); err != nil {
		tb.Fatalf("pgtest: migrate schema %s: %v", db.Schema, err)
	}
	// The example consumer's table, which no migration creates: tests
	// across the repository run the example side effects.
	if err := readmodel.Setup(ctx, db.Pool); err != nil {
		tb.Fatalf("pgtest: schema %s: %v", db.Schema, err)
	}
	return db
}

func newEmpty(tb testing.TB, base string) *DB {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		tb.Fatalf("pgtest: connect to %s: %v (is PostgreSQL running? see .ci/run)", redact.DSN(base), err)
	}
	defer admin.Close(ctx)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "t_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		tb.Fatalf("pgtest: create schema: %v", err)
	}
	url := WithSearchPath(base, schema)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatalf("pgtest: parse url: %v", err)
	}
	cfg.MaxConns = 16
	// The Lambdas talk to RDS Proxy in QueryExecModeExec (pkg/db): test every
	// query in that mode too, so a parameter that only encodes correctly with
	// a described statement fails here rather than in production.
	// FIFOBOX_TEST_QUERY_MODE=cache selects pgx's default (cached prepared
	// statements, for a direct connection) to benchmark that setup.
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	if os.Getenv("FIFOBOX_TEST_QUERY_MODE") == "cache" {
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: pool: %v", err)
	}
	tb.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, base)
		if err != nil {
			tb.Logf("pgtest: cleanup connect: %v", err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			tb.Logf("pgtest: drop schema %s: %v", schema, err)
		}
	})
	return &DB{Pool: pool, Schema: schema, URL: url}
}

// WithSearchPath returns url with search_path set to schema.
func WithSearchPath(url, schema string) string {
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "search_path=" + schema
}
