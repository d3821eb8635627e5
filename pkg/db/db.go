// Package db builds the PostgreSQL connection pool every fifobox process
// uses: a plain DSN locally, or RDS Proxy in AWS with an IAM auth token
// minted per new connection and TLS verified against trusted roots.
//
// The pool never depends on session state: statements run in
// QueryExecModeExec (no server-side prepared statements), so RDS Proxy does
// not pin connections and pgbouncer in transaction mode works; and nothing
// relies on query cancellation, which RDS Proxy does not support.
package db

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/feature/rds/auth"
	"github.com/aws/aws-sdk-go-v2/service/secretsmanager"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/redact"
)

// Config says how to reach PostgreSQL. Either URL, or Host/Name/User with IAMAuth.
type Config struct {
	// URL is a plain connection string (FIFOBOX_DATABASE_URL). Wins over the fields below.
	URL string
	// Host, Port, Name, User reach RDS Proxy (FIFOBOX_DB_HOST, FIFOBOX_DB_PORT (5432), FIFOBOX_DB_NAME, FIFOBOX_DB_USER).
	Host string
	Port int
	Name string
	User string
	// IAMAuth mints an RDS IAM auth token per new connection (FIFOBOX_DB_IAM_AUTH=true).
	IAMAuth bool
	// SecretARN instead authenticates with the user name and password of a
	// Secrets Manager secret (FIFOBOX_DB_SECRET_ARN), read for every new
	// connection so a rotation is picked up. Only the migration function
	// uses it: migrations run as the database owner (the master user),
	// straight to the cluster; every other function logs in with IAM as its
	// own role's user (migrations/00011_roles.sql).
	SecretARN string
	// FetchSecret reads SecretARN's credentials; default Secrets Manager.
	FetchSecret SecretFunc
	// Region for IAM tokens (AWS_REGION).
	Region string
	// CABundle is a PEM file of extra trusted roots (FIFOBOX_DB_CA_BUNDLE).
	// Not needed on AWS: RDS Proxy's certificates chain to Amazon roots in
	// the system store, and the RDS CAs (a cluster's own) are built in.
	CABundle string
	// MaxConns bounds the pool (FIFOBOX_DB_MAX_CONNS). Default 4: a Lambda
	// instance handles one invocation at a time.
	MaxConns int32
	// Schema holds fifobox's tables and functions (FIFOBOX_SCHEMA). Empty:
	// the search_path URL's options already set, else DefaultSchema. See
	// SearchPath.
	Schema string
}

// DefaultSchema is where fifobox's tables live unless FIFOBOX_SCHEMA (or the
// URL's search_path) says otherwise: its own schema, so a user's table named
// outbox or inbox is never shadowed by fifobox's.
const DefaultSchema = "fifobox"

// SearchPath is the search_path every fifobox connection starts with:
// fifobox's schema first, then the user's usual ones, because consumers run
// the user's side effects in the same transaction as their inbox row. It is
// a startup parameter, not a SET, so RDS Proxy does not pin the session.
func SearchPath(schema string) string {
	return pgx.Identifier{schema}.Sanitize() + `, "$user", public`
}

// ValidSchema reports whether name is a plain, unquoted-safe identifier
// (lower-case letters, digits, underscores; not starting with a digit; at
// most 63 bytes): the names a DBA would type without quotes.
func ValidSchema(name string) bool {
	if name == "" || len(name) > 63 || strings.HasPrefix(name, "pg_") {
		return false
	}
	for i, r := range name {
		switch {
		case r >= 'a' && r <= 'z', r == '_':
		case r >= '0' && r <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

// Env is every variable FromEnv reads (declare a new one here; the Lambda
// runtime contract tests check the CDK template against this list).
var Env = envspec.Set{
	{Name: "FIFOBOX_DATABASE_URL", Doc: "a plain PostgreSQL connection string; or the FIFOBOX_DB_* settings"},
	{Name: "FIFOBOX_DB_HOST", Doc: "RDS Proxy endpoint (with FIFOBOX_DB_NAME, FIFOBOX_DB_USER, FIFOBOX_DB_IAM_AUTH=true)"},
	{Name: "FIFOBOX_DB_PORT", Doc: "port (default 5432)"},
	{Name: "FIFOBOX_DB_NAME", Doc: "database name"},
	{Name: "FIFOBOX_DB_USER", Doc: "database user, authenticated with IAM tokens"},
	{Name: "FIFOBOX_DB_IAM_AUTH", Doc: "true: mint an IAM auth token per connection"},
	{Name: "FIFOBOX_DB_SECRET_ARN", Doc: "Secrets Manager secret (username, password) to log in with instead of IAM: the migration function's owner credentials"},
	{Name: "FIFOBOX_DB_CA_BUNDLE", Doc: "PEM file of extra trusted roots"},
	{Name: "FIFOBOX_DB_MAX_CONNS", Doc: "pool size (default 4)"},
	{Name: "FIFOBOX_SCHEMA", Doc: "schema of fifobox's tables (default: the URL's search_path, else fifobox)"},
	{Name: "AWS_REGION", Reserved: true, Doc: "region for IAM auth tokens (set by Lambda)"},
}

// FromEnv reads the configuration from the environment.
func FromEnv() (Config, error) {
	c := Config{
		URL: Env.Get("FIFOBOX_DATABASE_URL"), Host: Env.Get("FIFOBOX_DB_HOST"), Name: Env.Get("FIFOBOX_DB_NAME"),
		User: Env.Get("FIFOBOX_DB_USER"), Region: Env.Get("AWS_REGION"), CABundle: Env.Get("FIFOBOX_DB_CA_BUNDLE"),
		SecretARN: Env.Get("FIFOBOX_DB_SECRET_ARN"), Schema: Env.Get("FIFOBOX_SCHEMA"),
	}
	var err error
	if c.Port, err = intEnv("FIFOBOX_DB_PORT", 5432); err != nil {
		return c, err
	}
	maxConns, err := intEnv("FIFOBOX_DB_MAX_CONNS", 4)
	if err != nil {
		return c, err
	}
	c.MaxConns = int32(maxConns)
	if v := Env.Get("FIFOBOX_DB_IAM_AUTH"); v != "" {
		if c.IAMAuth, err = strconv.ParseBool(v); err != nil {
			return c, fmt.Errorf("FIFOBOX_DB_IAM_AUTH=%q: want true or false", v)
		}
	}
	return c, c.Validate()
}

func intEnv(name string, def int) (int, error) {
	v := Env.Get(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive integer", name, v)
	}
	return n, nil
}

// Validate names the first missing or invalid setting by its variable.
func (c Config) Validate() error {
	if c.Schema != "" && !ValidSchema(c.Schema) {
		return fmt.Errorf("FIFOBOX_SCHEMA=%q: want a lower-case identifier (letters, digits, _; not pg_*)", c.Schema)
	}
	if c.URL != "" {
		if _, err := pgxpool.ParseConfig(c.URL); err != nil {
			return fmt.Errorf("FIFOBOX_DATABASE_URL: %w", redact.Error(err, c.URL))
		}
		return nil
	}
	switch {
	case c.Host == "":
		return errors.New("FIFOBOX_DATABASE_URL or FIFOBOX_DB_HOST is required")
	case c.Name == "":
		return errors.New("FIFOBOX_DB_NAME is required with FIFOBOX_DB_HOST")
	case c.Port <= 0 || c.Port > 65535:
		return fmt.Errorf("FIFOBOX_DB_PORT=%d: must be 1-65535", c.Port)
	case c.IAMAuth && c.SecretARN != "":
		return errors.New("FIFOBOX_DB_SECRET_ARN: set it or FIFOBOX_DB_IAM_AUTH=true, not both")
	case c.SecretARN != "":
		if c.Region == "" {
			return errors.New("AWS_REGION is required with FIFOBOX_DB_SECRET_ARN")
		}
		return nil // the user name comes from the secret
	case c.User == "":
		return errors.New("FIFOBOX_DB_USER (or FIFOBOX_DB_SECRET_ARN) is required with FIFOBOX_DB_HOST")
	case c.IAMAuth && c.Region == "":
		return errors.New("AWS_REGION is required with FIFOBOX_DB_IAM_AUTH=true")
	case !c.IAMAuth:
		return errors.New("FIFOBOX_DB_IAM_AUTH=true (or FIFOBOX_DB_SECRET_ARN) is required with FIFOBOX_DB_HOST (passwords belong in FIFOBOX_DATABASE_URL)")
	}
	return nil
}

// rdsCABundle is the Amazon RDS certificate authorities' bundle (AWS
// publishes it as global-bundle.pem: every region's RSA2048, RSA4096 and
// ECC384 G1 roots, valid into the 2060s, and the 2019 CAs). Refresh it with
// scripts/update-rds-ca.sh.
//
//go:embed rds-ca-bundle.pem
var rdsCABundle []byte

// TokenFunc mints an IAM auth token for endpoint ("host:port").
type TokenFunc func(ctx context.Context, endpoint, region, user string, creds aws.CredentialsProvider) (string, error)

// PoolConfig builds the pgxpool configuration. creds is used for IAM tokens
// (nil when IAMAuth is off); mint defaults to auth.BuildAuthToken.
func PoolConfig(c Config, creds aws.CredentialsProvider, mint TokenFunc) (*pgxpool.Config, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	var pc *pgxpool.Config
	var err error
	if c.URL != "" {
		pc, err = pgxpool.ParseConfig(c.URL)
		if err != nil {
			return nil, fmt.Errorf("FIFOBOX_DATABASE_URL: %w", redact.Error(err, c.URL))
		}
	} else {
		dsn := (&url.URL{Scheme: "postgres", User: url.User(c.User), Host: net.JoinHostPort(c.Host, strconv.Itoa(c.Port)), Path: "/" + c.Name,
			RawQuery: "sslmode=verify-full"}).String()
		pc, err = pgxpool.ParseConfig(dsn)
		if err != nil {
			return nil, fmt.Errorf("database config: %w", err)
		}
		roots, err := x509.SystemCertPool()
		if err != nil || roots == nil {
			roots = x509.NewCertPool()
		}
		// RDS Proxy's certificates chain to Amazon roots in the system
		// store; a cluster's own (the migration function connects to the
		// writer directly) chain to the RDS CAs, which are not there.
		roots.AppendCertsFromPEM(rdsCABundle)
		if c.CABundle != "" {
			pem, err := os.ReadFile(c.CABundle)
			if err != nil {
				return nil, fmt.Errorf("FIFOBOX_DB_CA_BUNDLE: %w", err)
			}
			if !roots.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("FIFOBOX_DB_CA_BUNDLE=%s: no PEM certificates", c.CABundle)
			}
		}
		pc.ConnConfig.TLSConfig = &tls.Config{ServerName: c.Host, RootCAs: roots, MinVersion: tls.VersionTLS12}
		pc.ConnConfig.Fallbacks = nil // never fall back to plaintext
		if c.SecretARN != "" {
			fetch := c.FetchSecret
			if fetch == nil {
				if creds == nil {
					return nil, errors.New("database config: FIFOBOX_DB_SECRET_ARN needs AWS credentials")
				}
				fetch = secretsManagerFetch(c.Region, creds)
			}
			// Read for every new connection: a rotated password is picked up.
			pc.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
				user, password, err := fetch(ctx, c.SecretARN)
				if err != nil {
					return fmt.Errorf("read database secret: %w", err)
				}
				cc.User, cc.Password = user, password
				return nil
			}
			return finishPoolConfig(pc, c), nil
		}
		if mint == nil {
			mint = func(ctx context.Context, endpoint, region, user string, creds aws.CredentialsProvider) (string, error) {
				return auth.BuildAuthToken(ctx, endpoint, region, user, creds)
			}
		}
		if creds == nil {
			return nil, errors.New("database config: IAM auth needs AWS credentials")
		}
		endpoint := net.JoinHostPort(c.Host, strconv.Itoa(c.Port))
		// Tokens live 15 minutes and are checked only at connect time: mint
		// one for every new connection.
		pc.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
			tok, err := mint(ctx, endpoint, c.Region, c.User, creds)
			if err != nil {
				return fmt.Errorf("mint RDS IAM auth token: %w", err)
			}
			cc.Password = tok
			return nil
		}
	}
	return finishPoolConfig(pc, c), nil
}

func finishPoolConfig(pc *pgxpool.Config, c Config) *pgxpool.Config {
	pc.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	pc.MaxConns = c.MaxConns
	if pc.MaxConns <= 0 {
		pc.MaxConns = 4
	}
	pc.MaxConnIdleTime = 5 * time.Minute
	pc.ConnConfig.ConnectTimeout = ConnectTimeout
	// FIFOBOX_SCHEMA wins; a search_path the URL sets (tests, users who
	// pinned one) is kept as it is; otherwise fifobox's own schema.
	if c.Schema != "" {
		pc.ConnConfig.RuntimeParams["search_path"] = SearchPath(c.Schema)
	} else if pc.ConnConfig.RuntimeParams["search_path"] == "" {
		pc.ConnConfig.RuntimeParams["search_path"] = SearchPath(DefaultSchema)
	}
	return pc
}

// SecretFunc returns the user name and password held by a secret.
type SecretFunc func(ctx context.Context, arn string) (user, password string, err error)

// secretsManagerFetch reads an RDS-style secret (JSON with username and
// password, as RDS generates for a cluster's master user).
func secretsManagerFetch(region string, creds aws.CredentialsProvider) SecretFunc {
	client := secretsmanager.NewFromConfig(aws.Config{Region: region, Credentials: creds})
	return func(ctx context.Context, arn string) (string, string, error) {
		out, err := client.GetSecretValue(ctx, &secretsmanager.GetSecretValueInput{SecretId: aws.String(arn)})
		if err != nil {
			return "", "", err
		}
		var v struct {
			Username string `json:"username"`
			Password string `json:"password"`
		}
		if out.SecretString == nil || json.Unmarshal([]byte(*out.SecretString), &v) != nil || v.Username == "" || v.Password == "" {
			return "", "", errors.New("secret is not JSON with username and password")
		}
		return v.Username, v.Password, nil
	}
}

// ConnectTimeout bounds one connection attempt (dial, TLS, authentication).
const ConnectTimeout = 5 * time.Second

// OpenTimeout bounds Open's first connection (all attempts together, e.g.
// TLS then plaintext with sslmode=prefer). A Lambda's init has 10 s in all;
// callers there pass a context with a shorter deadline (lambdafn.InitTimeout),
// which wins.
const OpenTimeout = 8 * time.Second

// Open builds the pool and checks it can connect, within OpenTimeout or
// ctx's deadline, whichever comes first.
func Open(ctx context.Context, c Config, creds aws.CredentialsProvider) (*pgxpool.Pool, error) {
	pc, err := PoolConfig(c, creds, nil)
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("open database pool: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, OpenTimeout)
	defer cancel()
	err = pool.Ping(pctx)
	if err != nil && refusesSearchPath(err) {
		// A connection pooler (PgBouncer before 1.20, for one) refuses
		// search_path as a startup parameter. Connect without it: fifobox's
		// schema must then be on the search_path the server gives this role
		// (ALTER ROLE ... SET search_path, docs/operations.md); if it is not,
		// every statement fails loudly with "relation does not exist".
		pool.Close()
		slog.Warn("the database (or a pooler in front of it) refuses search_path at connect: using the role's own search_path",
			"host", pc.ConnConfig.Host, "search_path", pc.ConnConfig.RuntimeParams["search_path"])
		delete(pc.ConnConfig.RuntimeParams, "search_path")
		if pool, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
			return nil, fmt.Errorf("open database pool: %w", err)
		}
		err = pool.Ping(pctx)
	}
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to database %s: %w", pc.ConnConfig.Host, err)
	}
	return pool, nil
}

// refusesSearchPath reports whether the server or a pooler refused the
// search_path startup parameter.
func refusesSearchPath(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "08P01" && strings.Contains(pe.Message, "search_path")
}
