package amqp

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/transport"
)

// EnvSecretARN names the Secrets Manager secret holding the broker user's
// credentials: on AWS the functions read them at init, so no password sits
// in a function's configuration.
const EnvSecretARN = "FIFOBOX_AMQP_SECRET_ARN"

// OpenEnv is every variable transport.Open reads for RabbitMQ: Env, the
// wire profile's (ProfileEnv) and the secret's ARN.
var OpenEnv = envspec.Join(Env, ProfileEnv, envspec.Set{
	{Name: EnvSecretARN, Doc: `Secrets Manager secret {"username","password"} for FIFOBOX_AMQP_URL (Amazon MQ: the event source mapping's BASIC_AUTH secret); unset: credentials in the URL`},
})

func init() {
	transport.Register(transport.RabbitMQ, transport.Opener{Env: OpenEnv, Open: open})
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
		if cfg.URL, err = withSecret(ctx, cfg.URL, arn, o.Secret); err != nil {
			return nil, err
		}
	}
	return New(cfg)
}

// withSecret puts the secret's {"username","password"} into raw, a URL
// without credentials. Errors name the variable and never carry the
// secret's value.
func withSecret(ctx context.Context, raw, arn string, fetch transport.SecretFunc) (string, error) {
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return "", fmt.Errorf("%s: %w", EnvURL, err)
	case u.User != nil:
		return "", fmt.Errorf("%s and credentials in %s: set one or the other", EnvSecretARN, EnvURL)
	case fetch == nil:
		return "", fmt.Errorf("%s is set, but this program reads no secrets: put the credentials in %s", EnvSecretARN, EnvURL)
	}
	ctx, cancel := context.WithTimeout(ctx, secretTimeout)
	defer cancel()
	v, err := fetch(ctx, arn)
	if err != nil {
		return "", fmt.Errorf("%s: read secret: %w", EnvSecretARN, err)
	}
	var s struct {
		Username string `json:"username"`
		Password string `json:"password"`
	}
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return "", fmt.Errorf("%s: secret is not a JSON object", EnvSecretARN)
	}
	if s.Username == "" || s.Password == "" {
		return "", fmt.Errorf("%s: secret needs username and password", EnvSecretARN)
	}
	u.User = url.UserPassword(s.Username, s.Password)
	return u.String(), nil
}
