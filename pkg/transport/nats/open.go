package nats

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/wire"
)

// EnvSecretARN names the Secrets Manager secret holding the server
// credentials: on AWS the functions read them at init, so no password or
// token sits in a function's configuration.
const EnvSecretARN = "FIFOBOX_NATS_SECRET_ARN"

// OpenEnv is every variable transport.Open reads for NATS: Env, the wire
// profile's (FIFOBOX_PROFILE) and the secret's ARN.
var OpenEnv = envspec.Join(Env, wire.Env, inbox.TableEnv, envspec.Set{
	{Name: EnvSecretARN, Doc: `Secrets Manager secret {"username","password"}, {"token"} or {"creds"} (a .creds file's contents) for FIFOBOX_NATS_URL; unset: none or FIFOBOX_NATS_CREDS/USER/PASSWORD`},
})

func init() {
	transport.Register(transport.NATS, transport.Opener{Env: OpenEnv, Open: open})
}

// secretTimeout bounds reading the secret (inside a Lambda's 10 s init).
const secretTimeout = 7 * time.Second

func open(ctx context.Context, o transport.Options) (transport.Transport, error) {
	cfg, err := ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	cfg.Logger = o.Logger
	if arn := OpenEnv.Get(EnvSecretARN); arn != "" {
		if cfg.CredsFile != "" || cfg.User != "" {
			return nil, fmt.Errorf("%s and %s or %s: set one kind of credentials", EnvSecretARN, EnvCredsFile, EnvUser)
		}
		if err := withSecret(ctx, &cfg, arn, o.Secret); err != nil {
			return nil, err
		}
	}
	return New(cfg)
}

// withSecret puts the secret's credentials into cfg: {"username",
// "password"}, {"token"} or {"creds"} (a .creds file's contents). Errors
// name the variable and never carry the secret's value.
func withSecret(ctx context.Context, cfg *Config, arn string, fetch transport.SecretFunc) error {
	if fetch == nil {
		return fmt.Errorf("%s is set, but this program reads no secrets: use %s or %s", EnvSecretARN, EnvCredsFile, EnvUser)
	}
	ctx, cancel := context.WithTimeout(ctx, secretTimeout)
	defer cancel()
	v, err := fetch(ctx, arn)
	if err != nil {
		return fmt.Errorf("%s: read secret: %w", EnvSecretARN, err)
	}
	var s struct {
		Username string `json:"username"`
		Password string `json:"password"`
		Token    string `json:"token"`
		Creds    string `json:"creds"`
	}
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return fmt.Errorf("%s: secret is not a JSON object", EnvSecretARN)
	}
	switch {
	case s.Creds != "" && s.Username == "" && s.Token == "":
		// nats.go reads credentials from a file; /tmp is the only
		// writable place in a Lambda, and only this process reads it.
		f := filepath.Join(os.TempDir(), "fifobox-nats.creds")
		if err := os.WriteFile(f, []byte(s.Creds), 0o600); err != nil {
			return fmt.Errorf("%s: write credentials file: %w", EnvSecretARN, err)
		}
		cfg.CredsFile = f
	case s.Token != "" && s.Username == "" && s.Creds == "":
		cfg.Token = s.Token
	case s.Username != "" && s.Password != "" && s.Token == "" && s.Creds == "":
		cfg.User, cfg.Password = s.Username, s.Password
	default:
		return fmt.Errorf("%s: secret needs exactly one of username+password, token or creds", EnvSecretARN)
	}
	return nil
}
