package nats_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/nats"
)

func TestOpenFromEnv(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		wantErr string // a variable the error must name
	}{
		{"plain URL", map[string]string{"FIFOBOX_NATS_URL": "tls://nats.internal:4222"}, ""},
		{"secret and user", map[string]string{"FIFOBOX_NATS_SECRET_ARN": "arn:s", "FIFOBOX_NATS_USER": "u", "FIFOBOX_NATS_PASSWORD": "p"}, "FIFOBOX_NATS_SECRET_ARN"},
		{"bad URL", map[string]string{"FIFOBOX_NATS_URL": "http://h:4222"}, "FIFOBOX_NATS_URL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, v := range transport.RegisteredEnv() {
				t.Setenv(v.Name, "")
			}
			t.Setenv("FIFOBOX_TRANSPORT", "nats")
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			tr, err := transport.Open(context.Background(), transport.Options{})
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
			case err == nil:
				if tr.Kind() != transport.NATS {
					t.Fatalf("kind %s", tr.Kind())
				}
				_ = tr.Close()
			}
		})
	}
}

// The secret's credentials end up where the client reads them, and a bad
// secret fails with the variable's name and never its value.
func TestOpenReadsTheSecret(t *testing.T) {
	const password = "s3cret-Pa55word/with?odd@chars"
	tests := []struct {
		name, secret, wantErr string
		check                 func(t *testing.T, c nats.Config)
	}{
		{"user", `{"username":"fifobox","password":"` + password + `"}`, "", func(t *testing.T, c nats.Config) {
			if c.User != "fifobox" || c.Password != password {
				t.Errorf("user %q", c.User)
			}
		}},
		{"token", `{"token":"` + password + `"}`, "", func(t *testing.T, c nats.Config) {
			if c.Token != password {
				t.Error("token not set")
			}
		}},
		{"creds", `{"creds":"-----BEGIN NATS USER JWT-----\nx\n"}`, "", func(t *testing.T, c nats.Config) {
			got, err := os.ReadFile(c.CredsFile)
			if err != nil || !strings.HasPrefix(string(got), "-----BEGIN NATS USER JWT-----\nx") {
				t.Errorf("creds file %s: %q %v", c.CredsFile, got, err)
			}
			if st, err := os.Stat(c.CredsFile); err != nil || st.Mode().Perm() != 0o600 {
				t.Errorf("creds file mode %v %v, want 0600", st.Mode(), err)
			}
		}},
		{"two kinds", `{"token":"t","username":"u","password":"p"}`, "FIFOBOX_NATS_SECRET_ARN", nil},
		{"not JSON", password, "FIFOBOX_NATS_SECRET_ARN", nil},
		{"unreadable", "", "FIFOBOX_NATS_SECRET_ARN", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, v := range transport.RegisteredEnv() {
				t.Setenv(v.Name, "")
			}
			t.Setenv("TMPDIR", t.TempDir())
			t.Setenv("FIFOBOX_TRANSPORT", "nats")
			t.Setenv("FIFOBOX_NATS_URL", "tls://nats.internal:4222")
			t.Setenv("FIFOBOX_NATS_SECRET_ARN", "arn:nats")
			fetch := func(_ context.Context, arn string) (string, error) {
				if tt.secret == "" {
					return "", errors.New("AccessDeniedException")
				}
				if arn != "arn:nats" {
					return "", errors.New("wrong secret")
				}
				return tt.secret, nil
			}
			tr, err := transport.Open(context.Background(), transport.Options{Secret: fetch})
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
			case err != nil && strings.Contains(err.Error(), password):
				t.Fatalf("error carries the secret: %v", err)
			}
			if tt.check != nil {
				defer tr.Close()
				tt.check(t, tr.(*nats.Transport).Config())
			}
		})
	}
}
