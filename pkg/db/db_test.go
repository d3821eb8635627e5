package db_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/feature/rds/auth"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/db"
)

func TestFromEnvValidationNamesTheVariable(t *testing.T) {
	cases := []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{}, "FIFOBOX_DATABASE_URL or FIFOBOX_DB_HOST"},
		{map[string]string{"FIFOBOX_DB_HOST": "proxy"}, "FIFOBOX_DB_NAME"},
		{map[string]string{"FIFOBOX_DB_HOST": "proxy", "FIFOBOX_DB_NAME": "app"}, "FIFOBOX_DB_USER"},
		{map[string]string{"FIFOBOX_DB_HOST": "proxy", "FIFOBOX_DB_NAME": "app", "FIFOBOX_DB_USER": "u", "FIFOBOX_DB_PORT": "x"}, "FIFOBOX_DB_PORT"},
		{map[string]string{"FIFOBOX_DB_HOST": "proxy", "FIFOBOX_DB_NAME": "app", "FIFOBOX_DB_USER": "u", "FIFOBOX_DB_IAM_AUTH": "maybe"}, "FIFOBOX_DB_IAM_AUTH"},
		{map[string]string{"FIFOBOX_DB_HOST": "proxy", "FIFOBOX_DB_NAME": "app", "FIFOBOX_DB_USER": "u", "FIFOBOX_DB_IAM_AUTH": "true", "AWS_REGION": ""}, "AWS_REGION"},
		{map[string]string{"FIFOBOX_DATABASE_URL": "postgres://u:secret@h:notaport/db"}, "FIFOBOX_DATABASE_URL"},
		{map[string]string{"FIFOBOX_DB_HOST": "cluster", "FIFOBOX_DB_NAME": "app", "FIFOBOX_DB_SECRET_ARN": "arn:s", "FIFOBOX_DB_IAM_AUTH": "true", "AWS_REGION": "eu-west-1"}, "FIFOBOX_DB_SECRET_ARN"},
		{map[string]string{"FIFOBOX_DB_HOST": "cluster", "FIFOBOX_DB_NAME": "app", "FIFOBOX_DB_SECRET_ARN": "arn:s"}, "AWS_REGION"},
		{map[string]string{"FIFOBOX_DATABASE_URL": "postgres://h/db", "FIFOBOX_SCHEMA": "Fifo Box"}, "FIFOBOX_SCHEMA"},
		{map[string]string{"FIFOBOX_DATABASE_URL": "postgres://h/db", "FIFOBOX_SCHEMA": "pg_catalog"}, "FIFOBOX_SCHEMA"},
	}
	for _, tc := range cases {
		for _, k := range []string{"FIFOBOX_DATABASE_URL", "FIFOBOX_DB_HOST", "FIFOBOX_DB_NAME", "FIFOBOX_DB_USER", "FIFOBOX_DB_PORT", "FIFOBOX_DB_IAM_AUTH", "AWS_REGION", "FIFOBOX_DB_MAX_CONNS", "FIFOBOX_DB_SECRET_ARN", "FIFOBOX_SCHEMA"} {
			t.Setenv(k, tc.env[k])
		}
		_, err := db.FromEnv()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("env %v: err %v, want it to name %s", tc.env, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "secret") {
			t.Errorf("error leaks the password: %v", err)
		}
	}
}

// The IAM path: every new connection gets a freshly minted token (checked
// by counting mints), signed for host:port and the user, over verified TLS,
// in the exec query mode that RDS Proxy does not pin.
func TestIAMTokenPerConnection(t *testing.T) {
	creds := credentials.NewStaticCredentialsProvider("AKIDEXAMPLE", "SECRETEXAMPLE", "")
	cfg := db.Config{Host: "proxy.example.internal", Port: 5432, Name: "app", User: "fifobox", IAMAuth: true, Region: "eu-west-1", MaxConns: 2}
	var mints atomic.Int32
	mint := func(ctx context.Context, endpoint, region, user string, c aws.CredentialsProvider) (string, error) {
		mints.Add(1)
		return auth.BuildAuthToken(ctx, endpoint, region, user, c)
	}
	pc, err := db.PoolConfig(cfg, creds, mint)
	if err != nil {
		t.Fatal(err)
	}
	if pc.ConnConfig.DefaultQueryExecMode != pgx.QueryExecModeExec {
		t.Fatalf("query mode %v, want exec (no prepared statements, no pinning)", pc.ConnConfig.DefaultQueryExecMode)
	}
	if pc.ConnConfig.TLSConfig == nil || pc.ConnConfig.TLSConfig.ServerName != cfg.Host || pc.ConnConfig.TLSConfig.InsecureSkipVerify {
		t.Fatalf("TLS not verified against the host: %+v", pc.ConnConfig.TLSConfig)
	}
	if len(pc.ConnConfig.Fallbacks) != 0 {
		t.Fatal("plaintext fallback configured")
	}
	for i := 1; i <= 3; i++ {
		cc := pc.ConnConfig.Copy()
		if err := pc.BeforeConnect(context.Background(), cc); err != nil {
			t.Fatal(err)
		}
		if int(mints.Load()) != i {
			t.Fatalf("connection %d: %d tokens minted", i, mints.Load())
		}
		u, err := url.Parse("https://" + cc.Password)
		if err != nil {
			t.Fatalf("token %q: %v", cc.Password, err)
		}
		q := u.Query()
		if u.Host != "proxy.example.internal:5432" || q.Get("Action") != "connect" || q.Get("DBUser") != "fifobox" ||
			q.Get("X-Amz-Signature") == "" || !strings.Contains(q.Get("X-Amz-Credential"), "AKIDEXAMPLE/") ||
			!strings.Contains(q.Get("X-Amz-Credential"), "/eu-west-1/rds-db/aws4_request") || q.Get("X-Amz-Expires") != "900" {
			t.Fatalf("token does not look like an RDS IAM token for the proxy: %s", cc.Password)
		}
	}
}

// The migration function's path: the owner's user name and password come
// from its secret, read again for every new connection (a rotated password
// is used from the next connection on), over verified TLS.
func TestSecretCredentialsPerConnection(t *testing.T) {
	password := "first"
	var reads int
	cfg := db.Config{Host: "cluster.example.internal", Port: 5432, Name: "app", SecretARN: "arn:aws:secretsmanager:eu-west-1:1:secret:db",
		Region: "eu-west-1", FetchSecret: func(_ context.Context, arn string) (string, string, error) {
			reads++
			if arn != "arn:aws:secretsmanager:eu-west-1:1:secret:db" {
				return "", "", fmt.Errorf("unexpected secret %s", arn)
			}
			return "master", password, nil
		}}
	pc, err := db.PoolConfig(cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if pc.ConnConfig.TLSConfig == nil || pc.ConnConfig.TLSConfig.ServerName != cfg.Host || len(pc.ConnConfig.Fallbacks) != 0 {
		t.Fatalf("TLS not verified against the host: %+v", pc.ConnConfig.TLSConfig)
	}
	for i, want := range []string{"first", "rotated"} {
		password = want
		cc := pc.ConnConfig.Copy()
		if err := pc.BeforeConnect(context.Background(), cc); err != nil {
			t.Fatal(err)
		}
		if cc.User != "master" || cc.Password != want || reads != i+1 {
			t.Fatalf("connection %d: user %q password %q after %d reads", i+1, cc.User, cc.Password, reads)
		}
	}
}

func TestPlainURL(t *testing.T) {
	pc, err := db.PoolConfig(db.Config{URL: "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if pc.BeforeConnect != nil || pc.ConnConfig.DefaultQueryExecMode != pgx.QueryExecModeExec || pc.MaxConns != 4 {
		t.Fatalf("plain config: %+v", pc)
	}
	pool, err := db.Open(context.Background(), db.Config{URL: "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pool.Close()
}

// Every pool starts with fifobox's schema first in search_path (a startup
// parameter, so no SET pins an RDS Proxy session): FIFOBOX_SCHEMA, else the
// URL's own search_path, else the fifobox schema; the user's schemas follow.
func TestSearchPath(t *testing.T) {
	const base = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	cases := []struct {
		url, schema, want string
	}{
		{base, "", `"fifobox", "$user", public`},
		{base, "events", `"events", "$user", public`},
		{base + "&search_path=t_1", "", "t_1"},
		{base + "&search_path=t_1", "events", `"events", "$user", public`},
	}
	for _, tc := range cases {
		pc, err := db.PoolConfig(db.Config{URL: tc.url, Schema: tc.schema}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := pc.ConnConfig.RuntimeParams["search_path"]; got != tc.want {
			t.Errorf("url %s schema %q: search_path %q, want %q", tc.url, tc.schema, got, tc.want)
		}
	}
	pool, err := db.Open(context.Background(), db.Config{URL: base, Schema: "events"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var path string
	if err := pool.QueryRow(context.Background(), "SHOW search_path").Scan(&path); err != nil {
		t.Fatal(err)
	}
	if path != `"events", "$user", public` {
		t.Errorf("server search_path %q", path)
	}
}

// The built-in RDS CA bundle parses and holds the current roots (a cluster's
// certificate chains to one of them), so the migration function's direct
// connection to the writer verifies its certificate.
func TestRDSCABundleIsBuiltIn(t *testing.T) {
	pc, err := db.PoolConfig(db.Config{Host: "cluster.example.internal", Port: 5432, Name: "app", SecretARN: "arn:s", Region: "eu-west-1",
		FetchSecret: func(context.Context, string) (string, string, error) { return "u", "p", nil }}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	roots := pc.ConnConfig.TLSConfig.RootCAs
	found := map[string]bool{}
	for _, want := range []string{"Amazon RDS us-east-1 Root CA RSA2048 G1", "Amazon RDS eu-west-1 Root CA ECC384 G1", "Amazon RDS us-east-1 Root CA RSA4096 G1"} {
		//nolint:staticcheck // Subjects lists the pool's own certificates (system roots too); enough to find ours.
		for _, raw := range roots.Subjects() {
			if strings.Contains(string(raw), want) {
				found[want] = true
			}
		}
		if !found[want] {
			t.Errorf("root %q not trusted", want)
		}
	}
}
